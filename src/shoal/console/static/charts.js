// Sparklines as inline SVG: a series of numbers (nulls skipped), scaled to its own maximum.
const NS = "http://www.w3.org/2000/svg";

export function sparkline(values, { width = 180, height = 36, color = "#2f5fd0" } = {}) {
  const svg = document.createElementNS(NS, "svg");
  svg.setAttribute("width", width);
  svg.setAttribute("height", height);
  svg.setAttribute("viewBox", `0 0 ${width} ${height}`);
  const known = values.filter((v) => v !== null && v !== undefined && Number.isFinite(v));
  if (known.length < 2) return svg;
  const top = Math.max(...known) || 1;
  const step = width / Math.max(1, values.length - 1);
  const points = values.map((v, i) => (v === null || v === undefined || !Number.isFinite(v))
    ? null : `${(i * step).toFixed(1)},${(height - 2 - (v / top) * (height - 4)).toFixed(1)}`).filter(Boolean);
  const line = document.createElementNS(NS, "polyline");
  line.setAttribute("points", points.join(" "));
  line.setAttribute("fill", "none");
  line.setAttribute("stroke", color);
  line.setAttribute("stroke-width", "1.5");
  svg.append(line);
  return svg;
}
