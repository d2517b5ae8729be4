// A trajectory: its steps page by page, and the whole log as JSONL.
import { h, api } from "./util.js";
import { stepTable } from "./steps.js";

export async function trajectoryPage({ show, params }, target) {
  const since = Number(params.get("since") || 0);
  const data = await api(`trajectory?target=${encodeURIComponent(target)}&since=${since}`);
  const sb = data.sandbox;
  const base = `#/trajectory/${encodeURIComponent(target)}`;
  show(
    h("h1", {}, `Trajectory ${sb.trajectory || sb.id}`),
    h("p", {}, "sandbox ", h("a", { href: `#/sandbox/${encodeURIComponent(sb.id)}` }, sb.id),
      ` · image ${sb.image} · ${sb.status}${sb.reason ? " (" + sb.reason + ")" : ""} · `,
      h("a", { id: "export", href: `api/trajectory/export?target=${encodeURIComponent(target)}`, download: `${sb.id}.jsonl` }, "export JSONL")),
    stepTable(data.steps),
    h("div", { class: "pager" },
      since > 0 ? h("a", { href: `${base}?since=${Math.max(0, since - 200)}` }, "← earlier") : null,
      data.next !== null ? h("a", { href: `${base}?since=${data.next}` }, "later →") : null));
}
