// The head view, as bertviz draws it: the text twice, queries in the left column and keys
// in the right, and a line from query i to key j for every head of the layer, in the
// head's colour, as opaque as the weight (a weight of 1 is solid, 0.1 a tenth). Every head
// of the layer is overlaid; the coloured boxes above turn a head on and off (a double
// click keeps that head alone). Hovering a query keeps its lines (what it attends to);
// hovering a key keeps the lines into it (which queries attend to it).
import { allowed, weight } from "./weights.js";
import { visibleText } from "./tokens.js";

export const HEAD_COLOURS = ["#1f77b4", "#ff7f0e", "#2ca02c", "#d62728", "#9467bd",
                             "#8c564b", "#e377c2", "#7f7f7f", "#bcbd22", "#17becf"];
export const MIN_LINE = 0.01;  // a line fainter than 1% is invisible, and would cost a node
const ROW = 20, TEXT = 120, GAP = 180;  // pixels: a token's row, a column's text, the lines
const SVG = "http://www.w3.org/2000/svg";

function svgElement(name, attributes) {
  const element = document.createElementNS(SVG, name);
  for (const [key, value] of Object.entries(attributes)) element.setAttribute(key, value);
  return element;
}

export class HeadView {
  /** box: the element to draw in; onLayer(l): the user picked layer l here. */
  constructor(box, onLayer) {
    this.box = box;
    this.onLayer = onLayer;
    this.hidden = new Set();  // heads turned off, kept across texts and layers
    this.focus = null;        // {side: "query" | "key", index} while a token is hovered
    this.drawn = "";
  }

  /** Draw layer `layer` of attention `a` (decoded); `version` changes with the text. */
  show(a, layer, version) {
    const key = `${version}|${layer}|${[...this.hidden].sort()}`;
    if (key === this.drawn) return;
    this.drawn = key;
    this.a = a;
    this.layer = layer;
    this.box.replaceChildren(this.toolbar(a, layer), this.picture(a, layer));
    this.applyFocus();
  }

  toolbar(a, layer) {
    const bar = document.createElement("div");
    bar.className = "hv-toolbar";
    const label = document.createElement("label");
    const select = document.createElement("select");
    select.className = "hv-layer";
    for (let l = 0; l < a.n_layers; l++) select.appendChild(new Option(`${l}`, l));
    select.value = String(layer);
    select.addEventListener("change", () => this.onLayer(Number(select.value)));
    label.append("layer ", select);
    bar.append(label, " heads ");
    for (let h = 0; h < a.n_heads; h++) {
      const toggle = document.createElement("button");
      toggle.type = "button";
      toggle.className = "hv-head" + (this.hidden.has(h) ? " off" : "");
      toggle.dataset.head = h;
      toggle.textContent = h;
      toggle.title = `head ${h}: click to hide or show, double-click to show it alone`;
      toggle.style.setProperty("--colour", HEAD_COLOURS[h % HEAD_COLOURS.length]);
      toggle.addEventListener("click", () => this.toggle(h));
      toggle.addEventListener("dblclick", () => this.only(h));
      bar.appendChild(toggle);
    }
    return bar;
  }

  toggle(h) {
    if (this.hidden.has(h)) this.hidden.delete(h);
    else this.hidden.add(h);
    this.show(this.a, this.layer, this.drawn.split("|")[0]);
  }

  only(h) {
    this.hidden = new Set(Array.from({ length: this.a.n_heads }, (_, k) => k).filter((k) => k !== h));
    this.show(this.a, this.layer, this.drawn.split("|")[0]);
  }

  // The SVG: lines first (under the text), then both columns of tokens.
  picture(a, layer) {
    const n = a.num_tokens, width = 2 * TEXT + GAP;
    const svg = svgElement("svg", { class: "hv", width, height: n * ROW + 4,
                                    viewBox: `0 0 ${width} ${n * ROW + 4}` });
    const lines = svgElement("g", { class: "lines" });
    const y = (k) => k * ROW + ROW / 2 + 2;
    for (let h = 0; h < a.n_heads; h++) {
      if (this.hidden.has(h)) continue;
      const colour = HEAD_COLOURS[h % HEAD_COLOURS.length];
      for (let i = 0; i < n; i++) {
        for (let j = 0; j <= i; j++) {
          const w = allowed(a, i, j) ? weight(a, layer, h, i, j) : 0;
          if (w < MIN_LINE) continue;
          lines.appendChild(svgElement("line", {
            x1: TEXT, y1: y(i), x2: TEXT + GAP, y2: y(j), stroke: colour, "stroke-width": 2,
            "stroke-opacity": w.toFixed(4), "data-head": h, "data-query": i, "data-key": j }));
        }
      }
    }
    svg.appendChild(lines);
    for (const [side, x, anchor] of [["query", TEXT - 6, "end"], ["key", TEXT + GAP + 6, "start"]]) {
      const column = svgElement("g", { class: `column ${side}` });
      for (let k = 0; k < n; k++) {
        const token = svgElement("g", { class: `token ${side}`, "data-index": k });
        token.appendChild(svgElement("rect", { x: anchor === "end" ? 0 : TEXT + GAP, y: k * ROW + 2,
                                               width: TEXT, height: ROW }));
        const text = svgElement("text", { x, y: y(k) + 5, "text-anchor": anchor });
        text.textContent = visibleText(a.tokens[k]);
        token.appendChild(text);
        token.addEventListener("mouseenter", () => { this.focus = { side, index: k }; this.applyFocus(); });
        token.addEventListener("mouseleave", () => { this.focus = null; this.applyFocus(); });
        column.appendChild(token);
      }
      svg.appendChild(column);
    }
    return svg;
  }

  // Keep the hovered token's lines and mark the tokens at their other ends.
  applyFocus() {
    const svg = this.box.querySelector("svg.hv");
    if (!svg) return;
    const f = this.focus;
    svg.classList.toggle("focus", f !== null);
    const linked = new Set();
    for (const line of svg.querySelectorAll("line")) {
      const on = f !== null && Number(line.dataset[f.side]) === f.index;
      line.classList.toggle("on", on);
      if (on) linked.add(Number(line.dataset[f.side === "query" ? "key" : "query"]));
    }
    for (const token of svg.querySelectorAll("g.token")) {
      const side = token.classList.contains("query") ? "query" : "key";
      const index = Number(token.dataset.index);
      token.classList.toggle("hover", f !== null && f.side === side && f.index === index);
      token.classList.toggle("linked", f !== null && f.side !== side && linked.has(index));
    }
  }
}
