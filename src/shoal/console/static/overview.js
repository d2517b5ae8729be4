// The farm at a glance: nodes, health, load, sandboxes by kind and state, create rate, queue depth and
// request latencies, polled every 2 s; the charts keep the last HISTORY samples in this page only.
import { h, api, ms, errorBox } from "./util.js";
import { sparkline } from "./charts.js";

const HISTORY = 90;
const POLL_MS = 2000;

export async function overview({ show, onLeave }) {
  const series = {};
  let last = null;
  let timer = null;
  let stopped = false;
  onLeave(() => { stopped = true; clearTimeout(timer); });
  const push = (name, value) => {
    (series[name] ||= []).push(value);
    if (series[name].length > HISTORY) series[name].shift();
    return series[name];
  };
  const card = (title, value, name, color) =>
    h("div", { class: "card", dataset: { metric: name } }, h("div", { class: "k" }, title), h("div", { class: "v" }, value),
      name ? sparkline(series[name] || [], { color }) : null);

  async function tick() {
    let data;
    try {
      data = await api("overview");
    } catch (error) {
      if (!stopped) show(errorBox(error));
      return;
    }
    if (stopped) return;
    const rate = last ? Math.max(0, (data.creates_total - last.creates_total) / (data.time - last.time)) : null;
    last = data;
    push("sandboxes", data.sandboxes);
    push("rate", rate);
    push("queue", data.queue_depth);
    const latencyCards = Object.entries(data.latency).map(([op, q]) => {
      push(`p50:${op}`, q.p50);
      push(`p99:${op}`, q.p99);
      return h("div", { class: "card" }, h("div", { class: "k" }, `${op} p50 / p99 (${q.count} requests)`),
        h("div", { class: "v" }, `${ms(q.p50)} / ${ms(q.p99)}`),
        sparkline(series[`p50:${op}`]), sparkline(series[`p99:${op}`], { color: "#c0392b" }));
    });
    const nodes = h("table", { id: "nodes" },
      h("tr", {}, ["node", "health", "sandboxes", "load"].map((t) => h("th", {}, t))),
      data.nodes.map((n) => h("tr", {}, h("td", {}, n.id),
        h("td", { class: n.healthy ? "ok" : "bad" }, n.healthy ? "healthy" : `down: ${n.reason || ""}`),
        h("td", {}, `${n.sandboxes} / ${n.max_sandboxes}`),
        h("td", {}, n.load === null ? "–" : `${(n.load * 100).toFixed(1)}%`))));
    const kinds = h("table", { id: "kinds" }, h("tr", {}, h("th", {}, "kind"), h("th", {}, "state"), h("th", {}, "sandboxes")),
      Object.entries(data.by_kind_state).flatMap(([kind, states]) => Object.entries(states).map(([state, n]) =>
        h("tr", {}, h("td", {}, kind), h("td", {}, state),
          h("td", {}, h("a", { href: `#/sandboxes?kind=${encodeURIComponent(kind)}&state=${encodeURIComponent(state)}` }, n))))));
    show(
      h("h1", {}, `Overview · ${data.where}`),
      h("div", { class: "cards" },
        card("sandboxes", data.sandboxes, "sandboxes"),
        card("creates / s", rate === null ? "…" : rate.toFixed(2), "rate", "#1b8a4a"),
        card("queue depth", data.queue_depth, "queue", "#8e44ad"),
        card("being created", data.creating)),
      h("h2", {}, "Nodes"), nodes,
      h("h2", {}, "Sandboxes by kind and state"), kinds,
      h("h2", {}, "Latency (from the request histograms)"),
      h("div", { class: "cards" }, latencyCards.length ? latencyCards : h("p", { class: "muted" }, "no requests yet")));
    timer = setTimeout(tick, POLL_MS);
  }
  await tick();
}
