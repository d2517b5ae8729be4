// The sandbox list: filters and paging are done by the server (one page of rows reaches the browser).
import { h, api, duration, labels } from "./util.js";

const FIELDS = [
  ["label", "label k=v"], ["kind", "kind"], ["state", "state"], ["owner", "owner / project"],
  ["min_age", "older than"], ["max_age", "younger than"], ["max_remaining", "ends within"], ["q", "id / image / trajectory"],
];

export async function sandboxList({ show, params }) {
  const offset = Number(params.get("offset") || 0);
  const limit = Number(params.get("limit") || 50);
  const data = await api("sandboxes?" + params.toString());
  const inputs = FIELDS.map(([name, title]) =>
    h("label", {}, title, h("input", { name, value: params.get(name) || "", size: name === "q" ? 18 : 10 })));
  const sort = h("select", { name: "sort" }, ["newest", "oldest", "remaining"].map((s) =>
    h("option", { value: s, selected: (params.get("sort") || "newest") === s }, s)));
  const form = h("form", { class: "filters", id: "filters", onsubmit: (event) => {
    event.preventDefault();
    const next = new URLSearchParams();
    for (const [key, value] of new FormData(form)) if (value) next.set(key, value);
    next.set("limit", String(limit));
    location.hash = "#/sandboxes?" + next.toString();
  } }, inputs, h("label", {}, "sort", sort), h("button", { type: "submit" }, "Filter"));
  const go = (delta) => {
    const next = new URLSearchParams(params);
    next.set("offset", String(Math.max(0, offset + delta)));
    location.hash = "#/sandboxes?" + next.toString();
  };
  const first = data.total ? offset + 1 : 0;
  const pager = h("div", { class: "pager" },
    h("button", { type: "button", disabled: offset === 0, onclick: () => go(-limit) }, "← previous"),
    h("span", { id: "range" }, `${first}–${offset + data.items.length} of ${data.total}`),
    h("button", { type: "button", disabled: offset + data.items.length >= data.total, onclick: () => go(limit) }, "next →"));
  const table = h("table", { id: "sandboxes", dataset: { total: data.total } },
    h("tr", {}, ["id", "kind", "image", "state", "owner", "labels", "age", "ends in", "steps"].map((t) => h("th", {}, t))),
    data.items.map((s) => h("tr", { dataset: { id: s.id } },
      h("td", {}, h("a", { href: `#/sandbox/${encodeURIComponent(s.id)}` }, s.id)),
      h("td", {}, s.kind), h("td", {}, s.image), h("td", {}, s.state),
      h("td", {}, [s.owner, s.project && `(${s.project})`].filter(Boolean).join(" ")),
      h("td", {}, labels(s.labels)), h("td", {}, duration(s.age_s)), h("td", {}, duration(s.remaining_s)),
      h("td", {}, s.trajectory ? h("a", { href: `#/trajectory/${encodeURIComponent(s.id)}` }, s.steps) : s.steps))));
  show(h("h1", {}, "Sandboxes"), form, pager, table);
  table.dataset.loaded = "1";
  window.__shoalRendered = performance.now();
}
