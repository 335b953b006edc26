// How a token's name is written on the page: as text in a chip, and with its spaces made
// visible where the exact characters matter (the candidates, the maps' labels).

// A chip shows the text as it reads: "bytes:\xe2" (part of a character) as \xe2, a newline
// as a return mark and a line break, a tab as an arrow.
export function chipText(name) {
  return name.replace(/^bytes:/, "").replace(/\n/g, "\u21b5\n").replace(/\t/g, "\u2192");
}

// Every character seen: a space as an open box, so "  " (two spaces) is not " " (one)
// however the browser lays the text out; newline and tab as marks on one line; any other
// control character as its Unicode picture (U+2400 + code, DEL as U+2421).
export function visibleText(name) {
  return name.replace(/^bytes:/, "").replace(/ /g, "\u2423").replace(/\n/g, "\u21b5")
    .replace(/\t/g, "\u2192").replace(/\x7f/g, "\u2421")
    .replace(/[\x00-\x1f]/g, (c) => String.fromCharCode(0x2400 + c.charCodeAt(0)));
}

// "query 5 a -> key 3 ␣b": one cell of a map, named by its tokens (spaces shown).
export function cellName(a, i, j) {
  return `query ${i} ${visibleText(a.tokens[i])} \u2192 key ${j} ${visibleText(a.tokens[j])}`;
}
