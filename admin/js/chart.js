// A small hand-written SVG line chart: tokens/s (left axis) and TTFT (right axis) over the last
// few minutes. No library: two polylines, a grid and four labels.

const SVG_NS = "http://www.w3.org/2000/svg";
const WIDTH = 1000;
const HEIGHT = 220;
const PAD = { left: 48, right: 56, top: 14, bottom: 24 };

function svg(tag, attrs = {}, text) {
  const el = document.createElementNS(SVG_NS, tag);
  for (const [k, v] of Object.entries(attrs)) el.setAttribute(k, String(v));
  if (text !== undefined) el.textContent = text;
  return el;
}

// A round upper bound for an axis so labels read well (1, 2, 5 x 10^k).
function niceMax(value) {
  if (!(value > 0)) return 1;
  const exp = Math.pow(10, Math.floor(Math.log10(value)));
  for (const step of [1, 2, 5, 10]) {
    if (value <= step * exp) return step * exp;
  }
  return 10 * exp;
}

function pathFor(points, x, y) {
  // Gaps (null values) break the line instead of drawing through zero.
  let d = "";
  let pen = false;
  for (const p of points) {
    if (p.value === null || p.value === undefined || Number.isNaN(p.value)) {
      pen = false;
      continue;
    }
    d += `${pen ? "L" : "M"}${x(p.t).toFixed(1)},${y(p.value).toFixed(1)} `;
    pen = true;
  }
  return d.trim();
}

/** Keeps samples for `windowSeconds` and redraws an <svg> inside `container`. */
export class ThroughputChart {
  constructor(container, windowSeconds = 300) {
    this.container = container;
    this.windowMs = windowSeconds * 1000;
    this.samples = []; // {t: ms, tps: number|null, ttftMs: number|null}
    this.root = svg("svg", {
      viewBox: `0 0 ${WIDTH} ${HEIGHT}`,
      class: "chart",
      role: "img",
      "aria-label": "Tokens per second and time to first token over the last minutes",
    });
    container.replaceChildren(this.root);
    this.draw();
  }

  add(sample) {
    this.samples.push(sample);
    const cutoff = sample.t - this.windowMs;
    while (this.samples.length && this.samples[0].t < cutoff) this.samples.shift();
    this.draw();
  }

  draw() {
    const root = this.root;
    root.replaceChildren();
    const now = this.samples.length ? this.samples[this.samples.length - 1].t : Date.now();
    const t0 = now - this.windowMs;
    const innerW = WIDTH - PAD.left - PAD.right;
    const innerH = HEIGHT - PAD.top - PAD.bottom;
    const maxTps = niceMax(Math.max(0, ...this.samples.map((s) => s.tps ?? 0)));
    const maxTtft = niceMax(Math.max(0, ...this.samples.map((s) => s.ttftMs ?? 0)));
    const x = (t) => PAD.left + ((t - t0) / this.windowMs) * innerW;
    const yTps = (v) => PAD.top + innerH - (v / maxTps) * innerH;
    const yTtft = (v) => PAD.top + innerH - (v / maxTtft) * innerH;

    for (let i = 0; i <= 4; i++) {
      const gy = PAD.top + (innerH * i) / 4;
      root.appendChild(svg("line", { x1: PAD.left, x2: WIDTH - PAD.right, y1: gy, y2: gy, class: "grid" }));
    }
    root.appendChild(svg("text", { x: PAD.left - 6, y: PAD.top + 4, class: "axis tps", "text-anchor": "end" }, String(maxTps)));
    root.appendChild(svg("text", { x: PAD.left - 6, y: PAD.top + innerH, class: "axis tps", "text-anchor": "end" }, "0"));
    root.appendChild(
      svg("text", { x: WIDTH - PAD.right + 6, y: PAD.top + 4, class: "axis ttft" }, `${maxTtft} ms`)
    );
    root.appendChild(svg("text", { x: WIDTH - PAD.right + 6, y: PAD.top + innerH, class: "axis ttft" }, "0"));
    const minutes = Math.round(this.windowMs / 60000);
    root.appendChild(svg("text", { x: PAD.left, y: HEIGHT - 6, class: "axis" }, `-${minutes} min`));
    root.appendChild(svg("text", { x: WIDTH - PAD.right, y: HEIGHT - 6, class: "axis", "text-anchor": "end" }, "now"));

    const tpsPoints = this.samples.map((s) => ({ t: s.t, value: s.tps }));
    const ttftPoints = this.samples.map((s) => ({ t: s.t, value: s.ttftMs }));
    root.appendChild(svg("path", { d: pathFor(tpsPoints, x, yTps), class: "line tps" }));
    root.appendChild(svg("path", { d: pathFor(ttftPoints, x, yTtft), class: "line ttft" }));
    // TTFT is measured only in intervals where a request started: mark each measurement, so a
    // lone one (no neighbour to draw a line to) still shows
    for (const p of ttftPoints) {
      if (p.value === null || p.value === undefined) continue;
      root.appendChild(svg("circle", { cx: x(p.t).toFixed(1), cy: yTtft(p.value).toFixed(1), r: 3, class: "dot ttft" }));
    }
    root.dataset.samples = String(this.samples.length);
    root.dataset.peakTps = String(Math.max(0, ...this.samples.map((s) => s.tps ?? 0)));
  }
}
