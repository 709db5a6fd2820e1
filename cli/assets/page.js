// The page of one process (/process?pid=PID): charts of its live bytes
// over time (sampled by the server: /api/history) and an icicle of the
// bytes allocated by call chain (/api/icicle), drawn on canvases and
// divs, refreshed every second. No libraries: served by alloctramp
// itself, for machines without internet.
"use strict";

const pid = new URLSearchParams(location.search).get("pid");
// Opaque colours, exact in a screenshot (the tests look for them).
const TOTAL_FILL = "#c6dbef", TOTAL_LINE = "#3182bd";
const PALETTE = ["#d62728", "#2ca02c", "#ff7f0e", "#9467bd", "#8c564b", "#e377c2", "#17becf", "#bcbd22"];

function human(b) {
  const units = ["B", "KiB", "MiB", "GiB", "TiB"];
  let v = Math.abs(b), i = 0;
  while (v >= 1024 && i < units.length - 1) { v /= 1024; i++; }
  return (b < 0 ? "-" : "") + (i === 0 ? String(v) : v.toFixed(1)) + " " + units[i];
}

// A chart of series [{values, color, fill}] over times (seconds).
function chart(canvas, times, series) {
  const g = canvas.getContext("2d");
  const W = canvas.width, H = canvas.height, L = 90, R = 16, T = 12, B = 28;
  g.fillStyle = "#fff";
  g.fillRect(0, 0, W, H);
  let max = 1;
  for (const s of series) for (const v of s.values) max = Math.max(max, v);
  const t0 = times[0], t1 = Math.max(times[times.length - 1], t0 + 1);
  const x = t => L + (W - L - R) * (t - t0) / (t1 - t0);
  const y = v => H - B - (H - T - B) * v / max;
  g.font = "11px sans-serif";
  g.strokeStyle = "#e4e4e4";
  g.fillStyle = "#555";
  g.lineWidth = 1;
  for (let i = 0; i <= 4; i++) {
    const v = max * i / 4, yy = Math.round(y(v)) + 0.5;
    g.beginPath(); g.moveTo(L, yy); g.lineTo(W - R, yy); g.stroke();
    g.textAlign = "right"; g.fillText(human(Math.round(v)), L - 6, yy + 4);
  }
  for (let i = 0; i <= 5; i++) {
    const t = t0 + (t1 - t0) * i / 5;
    g.textAlign = i === 0 ? "left" : i === 5 ? "right" : "center";
    g.fillText(new Date(t * 1000).toLocaleTimeString(), x(t), H - 8);
  }
  for (const s of series) {
    if (s.values.length === 0) continue;
    if (s.fill) {
      g.fillStyle = s.fill;
      g.beginPath();
      g.moveTo(x(times[0]), y(0));
      s.values.forEach((v, i) => {
        if (i > 0) g.lineTo(x(times[i]), y(s.values[i - 1]));
        g.lineTo(x(times[i]), y(v));
      });
      g.lineTo(x(times[s.values.length - 1]), y(0));
      g.closePath();
      g.fill();
    }
    g.strokeStyle = s.color;
    g.lineWidth = 3;
    g.beginPath();
    // Steps: a sample holds until the next one.
    s.values.forEach((v, i) => {
      if (i === 0) g.moveTo(x(times[0]), y(v));
      else { g.lineTo(x(times[i]), y(s.values[i - 1])); g.lineTo(x(times[i]), y(v)); }
    });
    if (s.values.length === 1) g.lineTo(x(times[0]) + 4, y(s.values[0]));
    g.stroke();
  }
}

function drawHistory(h) {
  document.getElementById("state").textContent =
    `${h.times.length} samples · ${h.live ? "live bytes" : "bytes requested (live tracking off)"} · ` +
    `now ${human(h.total[h.total.length - 1] || 0)}`;
  chart(document.getElementById("total"), h.times,
        [{ values: h.total, color: TOTAL_LINE, fill: TOTAL_FILL }]);
  // No site with live bytes: a flat line at zero.
  const none = [{ values: h.total.map(() => 0), color: "#ccc" }];
  chart(document.getElementById("sites"), h.times,
        h.sites.length ? h.sites.map((s, i) => ({ values: s.values, color: PALETTE[i % PALETTE.length] })) : none);
  const legend = document.getElementById("legend");
  legend.replaceChildren();
  h.sites.forEach((s, i) => {
    const li = document.createElement("li");
    const sw = document.createElement("span");
    sw.className = "sw";
    sw.style.background = PALETTE[i % PALETTE.length];
    li.append(sw, `${s.location} ${s.function} (${s.module}) ${s.values[s.values.length - 1]} B`);
    legend.append(li);
  });
}

// The icicle: one row per depth, each box as wide as its bytes' share.
function drawIcicle(d) {
  const box = document.getElementById("icicle");
  box.replaceChildren();
  const root = d.root;
  if (root.bytes === 0) {
    box.style.height = "24px";
    box.textContent = `No call chains recorded: \`alloctramp callers ${pid} on\` records them.`;
    return;
  }
  const W = box.clientWidth || 1100, ROW = 20;
  let depth = 0;
  const hue = name => { let h = 0; for (const c of name) h = (h * 31 + c.charCodeAt(0)) % 360; return h; };
  const place = (n, left, width, level) => {
    depth = Math.max(depth, level + 1);
    const div = document.createElement("div");
    div.className = "box";
    div.style.left = left + "px";
    div.style.top = level * ROW + "px";
    div.style.width = Math.max(width, 1) + "px";
    div.style.background = level === 0 ? "#ddd" : `hsl(${20 + hue(n.name) % 40}, 85%, ${n.children.length ? 72 : 62}%)`;
    div.title = `${n.name}: ${n.bytes} bytes, ${n.calls} calls`;
    if (width > 40) div.textContent = `${n.name} ${human(n.bytes)}`;
    box.append(div);
    let at = left;
    for (const c of n.children) {
      const w = width * c.bytes / n.bytes;
      place(c, at, w, level + 1);
      at += w;
    }
  };
  place(root, 0, W, 0);
  box.style.height = depth * ROW + "px";
}

async function refresh() {
  try {
    const h = await fetch(`/api/history?pid=${pid}`);
    if (!h.ok) {
      document.getElementById("state").textContent = (await h.text()).trim() + " (the last figures stay)";
      return;
    }
    drawHistory(await h.json());
    const i = await fetch(`/api/icicle?pid=${pid}`);
    if (i.ok) drawIcicle(await i.json());
    document.body.dataset.drawn = "yes";
  } catch (e) {
    document.getElementById("state").textContent = "the server is gone: " + e;
  } finally {
    setTimeout(refresh, 1000);
  }
}

refresh();
