// The side panel: the checkpoint (settings, size, steps, tokenizer, validation, loss
// curves) and the heads' roles as a clickable layer x head grid.

const $ = (id) => document.getElementById(id);

// Local/global layers: each layer's window, "full" for a global one ("3/full/3/full").
function layerWindows(s) {
  return s.layer_windows ? `, layer windows ${s.layer_windows.map((w) => w ?? "full").join("/")}` : "";
}

export function showCheckpoint(info) {
  $("model-name").textContent = info.model ? `: ${info.model}` : "";
  const s = info.settings, rows = [
    ["parameters", parametersText(info)],
    ["layers x heads", `${s.n_layers} x ${s.n_heads}, emb ${s.emb_dim}, context ${s.context_length}`],
    ["attention", `${s.position} positions${s.window_size ? `, window ${s.window_size}` : ""}${layerWindows(s)}, ${s.norm}, ${s.mlp}`],
    ["tokenizer", `${info.tokenizer.name} (${info.tokenizer.n_vocab.toLocaleString()} ids)`],
    ["training steps", info.steps === null ? "unknown" : info.steps.toLocaleString()],
    ["val bits per byte", info.val_bpb === null ? "not logged" : info.val_bpb.toFixed(3)],
    ["val loss", info.val_loss === null ? "not logged" : info.val_loss.toFixed(3)],
    ["checkpoint", info.path || "(given in Python)"],
  ];
  const table = document.createElement("table");
  for (const [name, value] of rows) {
    const tr = table.insertRow();
    tr.insertCell().textContent = name;
    tr.insertCell().textContent = value;
  }
  const settings = document.createElement("details");
  settings.innerHTML = "<summary>all settings</summary>";
  const pre = document.createElement("pre");
  pre.textContent = JSON.stringify(s, null, 1);
  settings.appendChild(pre);
  $("checkpoint").replaceChildren(table, settings);
  drawCurves(info.curves || {});
}

// "4,262,656: 3,214,080 in the blocks, 1,048,576 in the token embedding (tied: it is also
// the output head)": each part counted once, so a tied head is said, not hidden.
export function parametersText(info) {
  const n = (x) => x.toLocaleString(), parts = info.parameter_parts;
  if (!parts) return n(info.parameters);  // a server from before the parts
  const text = [`${n(parts.blocks)} in the blocks and final norm`,
                `${n(parts.token_embedding)} in the token embedding` +
                (info.tied_weights ? " (tied: it is also the output head)" : "")];
  if (parts.position_embedding) text.push(`${n(parts.position_embedding)} in the position embedding`);
  if (!info.tied_weights) text.push(`${n(parts.output_head)} in the output head (untied)`);
  return `${n(info.parameters)}: ${text.join(", ")}`;
}

function svgText(svg, text, attributes) {
  const t = document.createElementNS(svg.namespaceURI, "text");
  Object.entries({ "font-size": 10, ...attributes }).forEach(([k, v]) => t.setAttribute(k, v));
  t.textContent = text;
  svg.appendChild(t);
  return t;
}

function svgLine(svg, x1, y1, x2, y2, className) {
  const line = document.createElementNS(svg.namespaceURI, "line");
  Object.entries({ x1, y1, x2, y2, stroke: "#999", class: className })
    .forEach(([k, v]) => line.setAttribute(k, v));
  svg.appendChild(line);
}

// The loss curves in the 320 x 160 box: the plot from (X0, Y1) to (X1, Y0), with a step
// axis under it and a loss axis left of it, three ticks each.
const [X0, X1, Y0, Y1] = [42, 310, 8, 128];

function drawCurves(curves) {
  const svg = $("curves"), names = Object.keys(curves).filter((n) => n.endsWith("loss"));
  svg.replaceChildren();
  const note = (text) => {
    const t = document.createElementNS(svg.namespaceURI, "text");
    Object.entries({ x: 10, y: 80, "font-size": 11 }).forEach(([k, v]) => t.setAttribute(k, v));
    t.textContent = text;
    svg.appendChild(t);
  };
  if (!names.length) { note("no loss curves: the run directory is not beside the checkpoint"); return; }
  const all = names.flatMap((n) => curves[n].values), steps = names.flatMap((n) => curves[n].steps);
  const [lo, hi] = [Math.min(...all), Math.max(...all)], last = Math.max(...steps, 1);
  const x = (step) => X0 + ((X1 - X0) * step) / last;
  const y = (loss) => Y1 - ((Y1 - Y0) * (loss - lo)) / (hi - lo || 1);
  svgLine(svg, X0, Y1, X1, Y1, "axis");
  svgLine(svg, X0, Y0, X0, Y1, "axis");
  for (const step of [0, Math.round(last / 2), last]) {
    svgLine(svg, x(step), Y1, x(step), Y1 + 3, "tick");
    svgText(svg, step.toLocaleString(), { x: x(step), y: Y1 + 13, "text-anchor": "middle", class: "tick step" });
  }
  for (const loss of [lo, (lo + hi) / 2, hi]) {
    svgLine(svg, X0 - 3, y(loss), X0, y(loss), "tick");
    svgText(svg, loss.toFixed(2), { x: X0 - 5, y: y(loss) + 3, "text-anchor": "end", class: "tick loss" });
  }
  svgText(svg, "step", { x: (X0 + X1) / 2, y: 157, "text-anchor": "middle", class: "axis-label" });
  svgText(svg, "loss", { x: 10, y: (Y0 + Y1) / 2, "text-anchor": "middle", class: "axis-label",
                         transform: `rotate(-90 10 ${(Y0 + Y1) / 2})` });
  const colors = { "train/loss": "#69c", "val/loss": "#e60" };
  names.forEach((name, k) => {
    const c = curves[name];
    const points = c.steps.map((s, i) => `${x(s)},${y(c.values[i])}`);
    const line = document.createElementNS(svg.namespaceURI, "polyline");
    line.setAttribute("points", points.join(" "));
    line.setAttribute("fill", "none");
    line.setAttribute("stroke", colors[name] || "#333");
    line.setAttribute("class", "curve");
    svg.appendChild(line);
    const t = document.createElementNS(svg.namespaceURI, "text");
    Object.entries({ x: 200, y: 16 + 13 * k, "font-size": 11, fill: colors[name] || "#333" })
      .forEach(([key, v]) => t.setAttribute(key, v));
    t.textContent = `${name} ${c.values[c.values.length - 1].toFixed(3)}`;
    svg.appendChild(t);
  });
}

export function showRoles(roles, openHead) {
  const table = document.createElement("table"), heads = roles.previous_token[0].length;
  const top = table.insertRow();
  top.insertCell().textContent = "";
  for (let h = 0; h < heads; h++) top.insertCell().textContent = `H${h}`;
  roles.previous_token.forEach((row, l) => {
    const tr = table.insertRow();
    tr.insertCell().textContent = `L${l}`;
    row.forEach((p, h) => {
      const i = roles.induction[l][h], s = roles.sink[l][h];
      const td = tr.insertCell();
      td.className = "role";
      td.dataset.layer = l;
      td.dataset.head = h;
      td.textContent = `P ${p.toFixed(2)}\nI ${i.toFixed(2)}\nS ${s.toFixed(2)}`;
      td.style.whiteSpace = "pre";
      const [r, g, b] = [s, p, i].map((x) => Math.round(255 - 120 * Math.min(1, x)));
      td.style.background = `rgb(${g}, ${b}, ${r})`;
      td.addEventListener("click", () => openHead(l, h));
    });
  });
  $("roles").replaceChildren(table);
}
