// The console's entry: login, the hash router (#/, #/sandboxes?..., #/sandbox/ID, #/trajectory/TARGET).
import { h, api, LoginNeeded, errorBox } from "./util.js";
import { overview } from "./overview.js";
import { sandboxList } from "./sandboxes.js";
import { sandboxPage } from "./sandbox.js";
import { trajectoryPage } from "./trajectory.js";

const main = document.getElementById("main");
let cleanup = null; // what the current page must stop (timers, sockets) when another one opens
let generation = 0; // a page still loading when another opens must not draw over it

function show(...nodes) {
  main.replaceChildren(...nodes);
}

function loginPage(message) {
  document.getElementById("nav").hidden = true;
  const input = h("input", { type: "password", id: "token", placeholder: "token", autocomplete: "off" });
  const note = h("p", { class: "muted" }, message || "A project token shows that project's sandboxes; the cluster token shows all.");
  const form = h("form", { class: "login", id: "login", onsubmit: async (event) => {
    event.preventDefault();
    try {
      await api("login", { method: "POST", headers: { "Content-Type": "application/json" },
                           body: JSON.stringify({ token: input.value }) });
      input.value = "";
      route();
    } catch (error) {
      note.replaceWith(errorBox(error));
    }
  } }, h("h1", {}, "Log in"), note, input, h("button", { type: "submit" }, "Log in"));
  show(form);
  input.focus();
}

async function route() {
  if (cleanup) { cleanup(); cleanup = null; }
  const mine = ++generation;
  const current = () => mine === generation;
  const [path, query] = location.hash.replace(/^#/, "").split("?");
  const parts = (path || "/").split("/").filter(Boolean);
  try {
    const me = await api("me");
    document.getElementById("nav").hidden = false;
    document.getElementById("who").textContent = `${me.cluster ? "cluster" : "project " + me.project} · ${me.where}`;
    if (!current()) return;
    const context = {
      show: (...nodes) => { if (current()) show(...nodes); },
      params: new URLSearchParams(query || ""),
      onLeave: (fn) => { if (current()) cleanup = fn; else fn(); },
    };
    if (parts[0] === "sandboxes") await sandboxList(context);
    else if (parts[0] === "sandbox" && parts[1]) await sandboxPage(context, decodeURIComponent(parts[1]));
    else if (parts[0] === "trajectory" && parts[1]) await trajectoryPage(context, decodeURIComponent(parts.slice(1).join("/")));
    else await overview(context);
  } catch (error) {
    if (!current()) return;
    if (error instanceof LoginNeeded) loginPage(error.message);
    else show(errorBox(error));
  }
}

document.getElementById("logout").addEventListener("click", async () => {
  await fetch("api/logout", { method: "POST", credentials: "same-origin" });
  location.hash = "#/";
  loginPage("Logged out.");
});
window.addEventListener("hashchange", route);
route();
