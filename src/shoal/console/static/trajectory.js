// A trajectory: its steps page by page, and the whole log as JSONL.
import { h, api } from "./util.js";
import { stepTable } from "./steps.js";

export async function trajectoryPage({ show, params }, target) {
  const since = Number(params.get("since") || 0);
  const data = await api(`trajectory?target=${encodeURIComponent(target)}&since=${since}`);
  const sb = data.sandbox;
  const report = h("div", { id: "replay-report" });
  const base = `#/trajectory/${encodeURIComponent(target)}`;
  show(
    h("h1", {}, `Trajectory ${sb.trajectory || sb.id}`),
    h("p", {}, "sandbox ", h("a", { href: `#/sandbox/${encodeURIComponent(sb.id)}` }, sb.id),
      ` · image ${sb.image} · ${sb.status}${sb.reason ? " (" + sb.reason + ")" : ""} · `,
      h("a", { id: "export", href: `api/trajectory/export?target=${encodeURIComponent(target)}`, download: `${sb.id}.jsonl` }, "export JSONL"),
      " · ", h("button", { type: "button", id: "replay", onclick: () => replay(target, report) }, "Replay in a fresh sandbox")),
    report,
    stepTable(data.steps),
    h("div", { class: "pager" },
      since > 0 ? h("a", { href: `${base}?since=${Math.max(0, since - 200)}` }, "← earlier") : null,
      data.next !== null ? h("a", { href: `${base}?since=${data.next}` }, "later →") : null));
}

async function replay(target, box) {
  box.replaceChildren(h("p", { class: "muted" }, "replaying in a fresh sandbox…"));
  try {
    const r = await api(`trajectory/replay?target=${encodeURIComponent(target)}`, { method: "POST" });
    const value = (v) => (v === null || v === undefined ? "–" : typeof v === "string" ? v : JSON.stringify(v));
    box.replaceChildren(
      h("h2", {}, `Replay: ${r.steps} steps in ${r.sandbox_id}, ${r.differences.length} differences`),
      h("table", { id: "differences", dataset: { count: r.differences.length } },
        h("tr", {}, ["seq", "step", "field", "logged", "replayed"].map((t) => h("th", {}, t))),
        r.differences.map((d) => h("tr", {}, h("td", {}, d.seq), h("td", {}, h("code", {}, d.step)), h("td", {}, d.field),
          h("td", {}, h("pre", {}, value(d.logged))), h("td", {}, h("pre", {}, value(d.replayed)))))),
      r.skipped.length ? h("p", { class: "muted" }, `not replayed: ${r.skipped.map((s) => `#${s.seq} (${s.why})`).join("; ")}`) : null);
  } catch (error) {
    box.replaceChildren(h("p", { class: "error" }, error.message));
  }
}
