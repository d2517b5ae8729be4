// A terminal in the sandbox: a PTY kept by its agent, over a websocket. Keystrokes go to it as typed, what it
// prints is written here as it comes, and the window's size follows this element (full-screen programs such as
// top and vi redraw). The terminal's ID is kept for this tab (sessionStorage), so a reloaded page reattaches
// to the same terminal (same shell, same history) instead of starting another.
import { Terminal } from "./vendor/xterm/xterm.mjs";

const CELL_FALLBACK = { width: 8, height: 17 };

function cellSize(element, term) {  // what one character takes, from the rendered screen (its public DOM)
  const screen = element.querySelector(".xterm-screen");
  const box = screen ? screen.getBoundingClientRect() : null;
  return box && box.width > 0 && box.height > 0
    ? { width: box.width / term.cols, height: box.height / term.rows } : CELL_FALLBACK;
}

export function terminal(element, sandboxId) {
  const term = new Terminal({ cursorBlink: true, rows: 24, cols: 80, fontSize: 13 });
  term.open(element);
  const key = `shoal-terminal:${sandboxId}`;
  const scheme = location.protocol === "https:" ? "wss://" : "ws://";
  const fit = () => {
    const cell = cellSize(element, term);
    const cols = Math.max(20, Math.floor((element.clientWidth - 4) / cell.width));
    const rows = Math.max(5, Math.min(60, Math.floor((window.innerHeight * 0.45) / cell.height)));
    if (cols !== term.cols || rows !== term.rows) term.resize(cols, rows);
    element.dataset.size = `${term.rows} ${term.cols}`;  // as stty size prints it
  };
  fit();
  const query = new URLSearchParams({ cols: term.cols, rows: term.rows });
  const known = sessionStorage.getItem(key);
  if (known) query.set("id", known);
  const ws = new WebSocket(`${scheme}${location.host}${location.pathname}api/sandboxes/${encodeURIComponent(sandboxId)}/terminal?${query}`);
  ws.binaryType = "arraybuffer";
  const send = (order) => { if (ws.readyState === WebSocket.OPEN) ws.send(JSON.stringify(order)); };
  ws.addEventListener("message", (event) => {
    if (typeof event.data !== "string") { term.write(new Uint8Array(event.data)); return; }
    const msg = JSON.parse(event.data);
    if (msg.attached !== undefined) {
      sessionStorage.setItem(key, String(msg.attached));
      element.dataset.terminal = String(msg.attached);
      element.dataset.reattached = msg.reattached ? "1" : "0";
      element.dataset.ready = "1";
      send({ resize: [term.cols, term.rows] });
    } else if (msg.exit !== undefined) {
      sessionStorage.removeItem(key);
      term.write(`\r\n[the terminal ended: ${msg.signal ? "signal " + msg.signal : "exit " + msg.exit}]\r\n`);
    } else if (msg.error) {
      term.write(`\r\n\x1b[31m${msg.error}\x1b[0m\r\n`);
    }
  });
  ws.addEventListener("close", () => { element.dataset.ready = "0"; term.write("\r\n[disconnected]\r\n"); });
  term.onData((data) => send({ input: data }));
  term.onResize(({ cols, rows }) => send({ resize: [cols, rows] }));
  let pending = null;
  const onWindow = () => { clearTimeout(pending); pending = setTimeout(fit, 100); };
  window.addEventListener("resize", onWindow);
  return () => { window.removeEventListener("resize", onWindow); ws.close(); term.dispose(); };
}
