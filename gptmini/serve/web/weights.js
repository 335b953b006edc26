// The answer of /gptmini/attention, decoded: float16 (or uint8, or lists) weights of the
// lower triangle, the mask's bits, and one head's map as an image.


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

// Layer l, head h as an n x n image: darker = more weight, grey = masked.
export function headImage(a, l, h) {
  const n = a.num_tokens, image = new ImageData(n, n);
  for (let i = 0; i < n; i++) {
    for (let j = 0; j < n; j++) {
      const p = 4 * (i * n + j);
      if (!allowed(a, i, j)) {
        image.data.set([225, 225, 225, 255], p);
      } else {
        const w = Math.sqrt(weight(a, l, h, i, j));
        image.data.set([255 - 25 * w, 255 - 145 * w, 255 - 255 * w, 255], p);
      }
    }
  }
  return image;
}
