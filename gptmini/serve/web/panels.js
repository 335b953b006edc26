// The side panel: the checkpoint (settings, size, steps, tokenizer, validation, loss
// curves) and the heads' roles as a clickable layer x head grid.

const $ = (id) => document.getElementById(id);

export function showCheckpoint(info) {
  $("model-name").textContent = info.model ? `: ${info.model}` : "";
  const s = info.settings, rows = [
    ["parameters", `${info.parameters.toLocaleString()} (${info.non_embedding_parameters.toLocaleString()} without embeddings)`],
    ["layers x heads", `${s.n_layers} x ${s.n_heads}, emb ${s.emb_dim}, context ${s.context_length}`],
    ["attention", `${s.position} positions${s.window_size ? `, window ${s.window_size}` : ""}, ${s.norm}, ${s.mlp}`],
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
  const colors = { "train/loss": "#69c", "val/loss": "#e60" };
  names.forEach((name, k) => {
    const c = curves[name];
    const points = c.steps.map((s, i) => `${10 + (300 * s) / last},${150 - (130 * (c.values[i] - lo)) / (hi - lo || 1)}`);
    const line = document.createElementNS(svg.namespaceURI, "polyline");
    line.setAttribute("points", points.join(" "));
    line.setAttribute("fill", "none");
    line.setAttribute("stroke", colors[name] || "#333");
    line.setAttribute("class", "curve");
    svg.appendChild(line);
    const t = document.createElementNS(svg.namespaceURI, "text");
    Object.entries({ x: 200, y: 14 + 13 * k, "font-size": 11, fill: colors[name] || "#333" })
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
