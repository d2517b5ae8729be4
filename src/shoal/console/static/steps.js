// A step table: what ran, its outputs or error, how long it took.
import { h } from "./util.js";

export function stepTable(steps) {
  return h("table", { id: "steps", dataset: { count: steps.length } },
    h("tr", {}, ["seq", "step", "exit", "output", "error", "took"].map((t) => h("th", {}, t))),
    steps.map((s) => h("tr", { dataset: { seq: s.seq } },
      h("td", {}, s.seq), h("td", {}, h("code", {}, s.summary)),
      h("td", {}, s.exit_code ?? ""),
      h("td", {}, s.stdout || s.stderr || s.result ? h("pre", {}, [s.stdout, s.stderr, s.result].filter(Boolean).join("\n")) : ""),
      h("td", { class: s.error ? "bad" : "" }, s.error || ""),
      h("td", {}, s.duration_ms === null ? "unfinished" : `${s.duration_ms} ms`))));
}
