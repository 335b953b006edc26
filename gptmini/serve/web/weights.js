// The answer of /gptmini/attention, decoded: float16 (or uint8, or lists) weights of the
// lower triangle, the mask's bits, the colour scale every view shares, and one head's map
// as an image.


function halfToFloat(bits) {
  const sign = bits & 0x8000 ? -1 : 1, exponent = (bits >> 10) & 0x1f, fraction = bits & 0x3ff;
  if (exponent === 0) return sign * fraction * 2 ** -24;
  if (exponent === 31) return fraction ? NaN : sign * Infinity;
  return sign * (1 + fraction / 1024) * 2 ** (exponent - 15);
}
const HALF = new Float32Array(65536).map((_, i) => halfToFloat(i));

function base64Bytes(text) {
  const raw = atob(text), bytes = new Uint8Array(raw.length);
  for (let i = 0; i < raw.length; i++) bytes[i] = raw.charCodeAt(i);
  return bytes;
}

export function decodeAttention(data) {
  const w = data.weights, cells = (data.num_tokens * (data.num_tokens + 1)) / 2;
  let values;
  if (w.encoding === "json") {
    values = Float32Array.from(w.data.flat(2));
  } else {
    const bytes = base64Bytes(w.data);
    if (w.encoding === "uint8") {
      values = Float32Array.from(bytes, (b) => b / 255);
    } else {
      const halves = new Uint16Array(bytes.buffer, bytes.byteOffset, bytes.length / 2);
      values = new Float32Array(halves.length);
      for (let i = 0; i < halves.length; i++) values[i] = HALF[halves[i]];
    }
  }
  return { ...data, cells, values, maskBits: base64Bytes(data.mask) };
}

// Weight of query i on key j (j <= i) in layer l, head h ("avg": the mean over heads).
export function weight(a, l, h, i, j) {
  const at = (head) => a.values[(l * a.n_heads + head) * a.cells + (i * (i + 1)) / 2 + j];
  if (h !== "avg") return at(h);
  let sum = 0;
  for (let head = 0; head < a.n_heads; head++) sum += at(head);
  return sum / a.n_heads;
}

export function allowed(a, i, j) {
  if (j > i) return false;
  const k = (i * (i + 1)) / 2 + j;
  return ((a.maskBits[k >> 3] >> (7 - (k & 7))) & 1) === 1;
}

// The colour scale, one for chips, maps and the legend: white (0) to orange (1). "row"
// divides a weight by the largest weight its query gives any key, so a query spread
// evenly over many keys still shows (layer 0's average is near uniform: 1/n per key would
// be almost white); "weight" shows the weight itself.
export const SCALES = { row: "share of the query's largest weight", weight: "weight" };
export const ORANGE = [230, 110, 0];

export function rowMax(a, l, h, i) {
  let most = 0;
  for (let j = 0; j <= i; j++) if (allowed(a, i, j)) most = Math.max(most, weight(a, l, h, i, j));
  return most;
}

// How strongly (0..1) to colour weight w of query i under `scale`; `most` is rowMax.
export function shade(w, most, scale) {
  if (scale === "weight") return Math.min(1, w);
  return most > 0 ? Math.min(1, w / most) : 0;
}

// Layer l, head h as an n x n image (row = query, column = key): more weight is more
// orange, grey is masked.
export function headImage(a, l, h, scale = "row") {
  const n = a.num_tokens, image = new ImageData(n, n), [r, g, b] = ORANGE;
  for (let i = 0; i < n; i++) {
    const most = scale === "row" ? rowMax(a, l, h, i) : 1;
    for (let j = 0; j < n; j++) {
      const p = 4 * (i * n + j);
      if (!allowed(a, i, j)) {
        image.data.set([225, 225, 225, 255], p);
      } else {
        const s = shade(weight(a, l, h, i, j), most, scale);
        image.data.set([255 - (255 - r) * s, 255 - (255 - g) * s, 255 - (255 - b) * s, 255], p);
      }
    }
  }
  return image;
}
