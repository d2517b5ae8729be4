// One sandbox: what it is, its limits and network policy (now, and at create if it changed), its processes,
// its trajectory steps, a terminal (a PTY over a websocket, terminal.js), a file browser with downloads, and
// its screen if it has one (a screenshot on demand; a VM's live view, noVNC, in a frame).
import { h, api, duration, kvTable, labels } from "./util.js";
import { stepTable } from "./steps.js";
import { terminal } from "./terminal.js";

export async function sandboxPage({ show, onLeave }, id) {
  const data = await api(`sandboxes/${encodeURIComponent(id)}`);
  const info = data.info;
  const enc = encodeURIComponent(id);
  const procs = Array.isArray(data.processes)
    ? h("table", { id: "processes" }, h("tr", {}, ["pid", "command", "started by"].map((t) => h("th", {}, t))),
        data.processes.map((p) => h("tr", {}, h("td", {}, p.pid), h("td", {}, h("code", {}, p.command)),
          h("td", {}, p.exec_command ? h("code", {}, p.exec_command) : ""))))
    : h("p", { class: "muted" }, data.processes);
  const term = h("div", { class: "terminal", id: "terminal" });
  const files = h("div", { id: "files" });
  const screen = h("div", { class: "screen", id: "screen" });
  const shot = h("button", { type: "button", id: "take-screenshot", onclick: () => {
    const img = h("img", { id: "screenshot", alt: "screenshot", src: `api/sandboxes/${enc}/screenshot?t=${Date.now()}` });
    img.addEventListener("error", () => screen.replaceChildren(h("p", { class: "error" }, "no screenshot (a sandbox without a screen, or it failed)")));
    screen.replaceChildren(img);
  } }, "Take a screenshot");
  // the live view (noVNC, shoal/view.py) of a screen that has one: served by this same host under /view/
  const live = h("button", { type: "button", id: "open-live-view", onclick: async () => {
    try {
      const view = await api(`sandboxes/${enc}/view`);
      screen.replaceChildren(
        h("p", {}, h("a", { id: "live-view-link", href: view.path, target: "_blank", rel: "noopener" }, "open the live view in its own tab")),
        h("iframe", { id: "live-view", src: view.path, title: "live view", class: "live-view" }));
    } catch (error) {
      screen.replaceChildren(h("p", { class: "error" }, error.message));
    }
  } }, "Live view");
  show(
    h("h1", {}, `Sandbox ${id}`),
    kvTable({ kind: info.kind, image: info.image, state: info.state, owner: info.owner, project: info.project,
              trajectory: info.trajectory, age: duration(info.age_s), "ends in": duration(info.remaining_s),
              "on timeout": info.on_timeout, workdir: info.workdir }),
    h("p", {}, labels(info.labels)),
    h("h2", {}, "Resources"),
    typeof data.usage === "string" ? h("p", { class: "muted" }, data.usage) : h("div", { id: "usage" }, kvTable({
      "memory used": data.usage.memory_bytes === null ? "–" : `${(data.usage.memory_bytes / 1048576).toFixed(1)} MiB`,
      "memory limit": data.limits.memory_mb ? `${data.limits.memory_mb} MiB` : "none",
      "CPU time": data.usage.cpu_s === null ? "–" : `${data.usage.cpu_s.toFixed(2)} s`,
      "CPU limit": data.limits.cpu ?? "none",
      tasks: `${data.usage.pids ?? "–"} of ${data.limits.pids ?? "no limit"}`,
      "disk limit": data.limits.disk_mb ? `${data.limits.disk_mb} MiB` : "none",
    })),
    h("h2", {}, "Network policy"),
    h("div", { id: "network" }, kvTable(JSON.stringify(data.network) === JSON.stringify(data.network_at_create)
      ? { "now (as created)": JSON.stringify(data.network) }
      : { now: JSON.stringify(data.network), "at create": JSON.stringify(data.network_at_create) })),
    h("h2", {}, "Processes"), procs,
    h("h2", {}, "Terminal"), term,
    h("h2", {}, "Files"), files,
    h("h2", {}, "Screen"), data.screen ? h("div", {}, shot, data.live_view ? live : null, screen) : h("p", { class: "muted" }, "no screen (create with image=\"desktop\" or screen=(w, h))"),
    h("h2", {}, "Trajectory ", h("a", { href: `#/trajectory/${enc}` }, "(all steps, export)")),
    data.log_note ? h("p", { class: "muted" }, data.log_note) : stepTable(data.steps),
    h("h2", {}, "Spec at create"), h("pre", {}, JSON.stringify(data.spec, null, 2)));
  const stopTerminal = info.state === "closed" ? null : terminal(term, id);
  onLeave(() => stopTerminal && stopTerminal());
  await browse(files, id, info.workdir || "/");
}

async function browse(box, id, path) {
  let listing;
  try {
    listing = await api(`sandboxes/${encodeURIComponent(id)}/files?path=${encodeURIComponent(path)}`);
  } catch (error) {
    box.replaceChildren(h("p", { class: "error" }, error.message));
    return;
  }
  const join = (name) => (path.endsWith("/") ? path : path + "/") + name;
  const parent = path === "/" ? null : path.replace(/\/[^/]*\/?$/, "") || "/";
  box.replaceChildren(
    h("p", {}, h("code", { id: "cwd" }, path)),
    h("table", { id: "file-table" }, h("tr", {}, ["name", "size", "kind"].map((t) => h("th", {}, t))),
      parent ? h("tr", {}, h("td", {}, h("a", { href: "#", onclick: (e) => { e.preventDefault(); browse(box, id, parent); } }, "..")), h("td"), h("td")) : null,
      listing.entries.map((e) => h("tr", { dataset: { name: e.name } },
        h("td", {}, e.kind === "dir"
          ? h("a", { href: "#", onclick: (ev) => { ev.preventDefault(); browse(box, id, join(e.name)); } }, e.name + "/")
          : h("a", { href: `api/sandboxes/${encodeURIComponent(id)}/download?path=${encodeURIComponent(join(e.name))}`, download: e.name }, e.name)),
        h("td", {}, e.kind === "dir" ? "" : e.size), h("td", {}, e.kind)))));
}
