// A terminal on a persistent shell (sb.shell()): lines are edited here and each finished line runs in the
// sandbox's shell over a websocket; its output comes back whole when the command ends.
import { Terminal } from "./vendor/xterm/xterm.mjs";

const PROMPT = "$ ";

export function terminal(element, sandboxId) {
  const term = new Terminal({ convertEol: true, cursorBlink: true, rows: 16, fontSize: 13 });
  term.open(element);
  const scheme = location.protocol === "https:" ? "wss://" : "ws://";
  const ws = new WebSocket(`${scheme}${location.host}${location.pathname}api/sandboxes/${encodeURIComponent(sandboxId)}/shell`);
  let line = "";
  let ready = false;
  term.write("opening a shell…\r\n");
  ws.addEventListener("message", (event) => {
    const msg = JSON.parse(event.data);
    if (msg.ready) { ready = true; element.dataset.ready = "1"; term.write(PROMPT); return; }
    if (msg.error) term.write(`\x1b[31m${msg.error}\x1b[0m\r\n`);
    for (const part of [msg.stdout, msg.stderr]) {
      if (!part) continue;
      const text = typeof part === "string" ? part : "[binary output]";
      term.write(text.endsWith("\n") ? text : text + "\n");
    }
    if (msg.timed_out) term.write("\x1b[33m[timed out]\x1b[0m\r\n");
    if (ready) term.write(PROMPT);
  });
  ws.addEventListener("close", () => { ready = false; term.write("\r\n[shell closed]\r\n"); });
  term.onData((data) => {
    for (const ch of data) {
      if (ch === "\r" || ch === "\n") {
        term.write("\r\n");
        if (ready && ws.readyState === WebSocket.OPEN) ws.send(JSON.stringify({ cmd: line }));
        line = "";
      } else if (ch === "\x7f" || ch === "\b") {
        if (line) { line = line.slice(0, -1); term.write("\b \b"); }
      } else if (ch === "\x03") {
        line = ""; term.write("^C\r\n" + PROMPT);
      } else if (ch >= " ") {
        line += ch; term.write(ch);
      }
    }
  });
  return () => { ws.close(); term.dispose(); };
}
