// The model view: every layer and head at once, a row of small maps per layer (hover one to
// name a cell's tokens), and under it the large, token-labelled map of the head last
// clicked.
import { largeMap, smallMap } from "./maps.js";

export class ModelView {
  /** box: the element to draw in; onOpen(l, h): the user clicked layer l, head h. */
  constructor(box, onOpen) {
    this.box = box;
    this.onOpen = onOpen;
    this.open = null;  // [layer, head] of the large map, kept across texts
    this.drawn = "";
  }

  /** Draw attention `a` (decoded) under colour `scale`; `version` changes with the text. */
  show(a, scale, version) {
    const key = `${version}|${scale}|${this.open}`;
    if (key === this.drawn) return;
    this.drawn = key;
    const caption = document.createElement("div");
    caption.className = "caption";
    const grid = document.createElement("table");
    grid.className = "mv-grid";
    const top = grid.insertRow();
    top.insertCell();
    for (let h = 0; h < a.n_heads; h++) top.insertCell().textContent = `H${h}`;
    for (let l = 0; l < a.n_layers; l++) {
      const row = grid.insertRow();
      row.insertCell().textContent = `L${l}`;
      for (let h = 0; h < a.n_heads; h++) {
        const td = row.insertCell();
        td.className = "mv-cell";
        td.dataset.layer = l;
        td.dataset.head = h;
        if (this.open && this.open[0] === l && this.open[1] === h) td.classList.add("current");
        td.appendChild(smallMap(a, l, h, scale, caption));
        td.addEventListener("click", () => {
          this.open = [l, h];
          this.onOpen(l, h);
          this.show(a, scale, version);
        });
      }
    }
    const parts = [grid, caption];
    if (this.open && this.open[0] < a.n_layers && this.open[1] < a.n_heads) {
      // cells of 8 to 22 pixels: readable labels, and a 256-token text still fits a screen
      const cell = Math.max(8, Math.min(22, Math.floor(640 / a.num_tokens)));
      parts.push(largeMap(a, this.open[0], this.open[1], scale, cell));
    }
    this.box.replaceChildren(...parts);
  }
}
