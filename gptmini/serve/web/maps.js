// One head's map (row = query, column = key), small or large. A small map is a canvas of
// one pixel per cell, scaled up; hovering it names the cell's tokens and weight in a
// caption. The large map draws cells big enough to read and labels every row and column
// with its token.
import { allowed, headImage, weight } from "./weights.js";
import { cellName, visibleText } from "./tokens.js";

// The cell under the pointer in a canvas showing n x n cells, or null.
function cellAt(canvas, event, n) {
  const box = canvas.getBoundingClientRect();
  const j = Math.floor(((event.clientX - box.left) / box.width) * n);
  const i = Math.floor(((event.clientY - box.top) / box.height) * n);
  return i >= 0 && j >= 0 && i < n && j < n ? [i, j] : null;
}

function describe(a, l, h, cell) {
  if (!cell) return "";
  const [i, j] = cell, head = h === "avg" ? "average" : `H${h}`;
  const what = allowed(a, i, j) ? `weight ${weight(a, l, h, i, j).toFixed(4)}` : "masked";
  return `L${l} ${head}: ${cellName(a, i, j)}: ${what}`;
}

// Hovering `canvas` (n x n cells of layer l, head h) writes the cell into `caption`.
export function captionOnHover(canvas, a, l, h, caption) {
  canvas.addEventListener("mousemove", (event) => {
    const text = describe(a, l, h, cellAt(canvas, event, a.num_tokens));
    caption.textContent = text;
    canvas.title = text;
  });
  canvas.addEventListener("mouseleave", () => { caption.textContent = ""; });
}

// A small map: an n x n canvas (its size is CSS's), its image kept on `canvas.image`.
export function smallMap(a, l, h, scale, caption) {
  const canvas = document.createElement("canvas");
  canvas.width = a.num_tokens;
  canvas.height = a.num_tokens;
  canvas.image = headImage(a, l, h, scale);
  canvas.getContext("2d").putImageData(canvas.image, 0, 0);
  captionOnHover(canvas, a, l, h, caption);
  return canvas;
}

// The large map of layer l, head h: cells of `cell` pixels, the query tokens down the
// left, the key tokens along the top (written upwards), and a caption under it.
export function largeMap(a, l, h, scale, cell) {
  const n = a.num_tokens, labelWidth = 90, top = 90, font = Math.max(7, Math.min(12, cell - 2));
  const box = document.createElement("div");
  box.className = "large-map";
  box.dataset.layer = l;
  box.dataset.head = h;
  const plot = document.createElement("div");
  plot.className = "plot";
  plot.style.width = `${labelWidth + n * cell}px`;
  plot.style.height = `${top + n * cell}px`;
  const small = document.createElement("canvas");  // drawn at n x n, then scaled up sharp
  small.width = n;
  small.height = n;
  small.getContext("2d").putImageData(headImage(a, l, h, scale), 0, 0);
  const canvas = document.createElement("canvas");
  canvas.width = n * cell;
  canvas.height = n * cell;
  Object.assign(canvas.style, { left: `${labelWidth}px`, top: `${top}px` });
  const ctx = canvas.getContext("2d");
  ctx.imageSmoothingEnabled = false;
  ctx.drawImage(small, 0, 0, n * cell, n * cell);
  plot.appendChild(canvas);
  for (let k = 0; k < n; k++) {
    const text = visibleText(a.tokens[k]);
    const query = document.createElement("span");
    query.className = "label query";
    query.dataset.index = k;
    query.textContent = text;
    Object.assign(query.style, { top: `${top + k * cell}px`, width: `${labelWidth - 4}px`,
                                 height: `${cell}px`, fontSize: `${font}px`,
                                 lineHeight: `${cell}px` });
    const key = document.createElement("span");
    key.className = "label key";
    key.dataset.index = k;
    key.textContent = text;
    Object.assign(key.style, { left: `${labelWidth + k * cell}px`, width: `${cell}px`,
                               height: `${top - 4}px`, fontSize: `${font}px`,
                               lineHeight: `${cell}px` });
    plot.append(query, key);
  }
  const caption = document.createElement("div");
  caption.className = "caption";
  captionOnHover(canvas, a, l, h, caption);
  const title = document.createElement("div");
  title.className = "title";
  title.textContent = `layer ${l}, head ${h === "avg" ? "average" : h} (row = query, column = key)`;
  box.append(title, plot, caption);
  return box;
}
