(function () {
  const data = JSON.parse(document.getElementById('trace-data').textContent);
  const LANE = 18, PAD = 4;
  const known = {submit: '#4e79a7', queue_wait: '#bab0ac', claim: '#f28e2b', pack: '#edc948',
    forward: '#e15759', head: '#b07aa1', store: '#59a14f', ack: '#76b7b2', batch: '#9c755f',
    h2d: '#ff9da7', d2h: '#ff9da7'};
  function color(name) {
    if (known[name]) return known[name];
    let h = 0;
    for (const c of name) h = (h * 31 + c.charCodeAt(0)) % 360;
    return 'hsl(' + h + ',55%,50%)';
  }
  function fmt(ms) { return ms >= 1000 ? (ms / 1000).toFixed(3) + ' s' : ms.toFixed(3) + ' ms'; }
  function tickText(ms, step) {
    const unit = step >= 1000 ? 1000 : 1;
    const digits = Math.max(0, -Math.floor(Math.log10(step / unit) + 1e-9));
    return (ms / unit).toFixed(digits) + (unit === 1000 ? ' s' : ' ms');
  }
  const total = Math.max(data.total_ms, 0.001);
  let lo = 0, hi = total;
  const zoom = /zoom=([0-9.]+),([0-9.]+)/.exec(location.hash);
  if (zoom && +zoom[2] > +zoom[1]) { lo = +zoom[1]; hi = +zoom[2]; }
  document.getElementById('title').textContent = 'teacherq trace: ' + data.title;
  const tl = document.getElementById('timeline');
  const axis = document.createElement('div');
  axis.className = 'axis';
  tl.appendChild(axis);
  const tip = document.getElementById('tip');
  const names = new Set();
  const bars = [];
  for (const row of data.rows) {
    const div = document.createElement('div');
    div.className = 'row ' + row.kind;
    const label = document.createElement('div');
    label.className = 'label';
    label.textContent = row.label;
    label.title = row.label;
    const track = document.createElement('div');
    track.className = 'track';
    let lanes = 1;
    for (const s of row.spans) {
      names.add(s.name);
      lanes = Math.max(lanes, s.lane + 1);
      const bar = document.createElement('div');
      bar.className = 'bar' + (s.error ? ' error' : '');
      bar.dataset.span = s.id;
      bar.dataset.name = s.name;
      bar.style.top = (PAD / 2 + s.lane * LANE) + 'px';
      bar.style.background = color(s.name);
      bar.textContent = s.name;
      const lines = [s.name + '  ' + fmt(s.dur_ms) + '  @+' + fmt(s.start_ms), s.proc];
      for (const [k, v] of Object.entries(s.attrs)) lines.push(k + ' = ' + JSON.stringify(v));
      if (s.error) lines.push('ERROR ' + s.error);
      lines.push('(click: zoom to this span)');
      bar.title = lines.join('\n');
      bar.addEventListener('mousemove', ev => {
        tip.textContent = lines.join('\n');
        tip.style.display = 'block';
        tip.style.left = (ev.clientX + 12) + 'px';
        tip.style.top = (ev.clientY + 12) + 'px';
      });
      bar.addEventListener('mouseleave', () => { tip.style.display = 'none'; });
      bar.addEventListener('click', () => {
        const pad = Math.max(s.dur_ms * 0.05, 0.001);
        setRange(s.start_ms - pad, s.start_ms + s.dur_ms + pad);
      });
      track.appendChild(bar);
      bars.push([bar, s]);
    }
    track.style.height = (lanes * LANE + PAD) + 'px';
    div.appendChild(label);
    div.appendChild(track);
    tl.appendChild(div);
  }
  function draw() {
    const width = hi - lo;
    axis.textContent = '';
    const step0 = Math.pow(10, Math.floor(Math.log10(width / 5)));
    const step = [1, 2, 5, 10].map(m => m * step0).find(x => width / x <= 10) || step0 * 10;
    for (let t = Math.ceil(lo / step) * step; t <= hi; t += step) {
      const x = (t - lo) / width;
      if (x > 0.95) break;  // the label would run off the page
      const tick = document.createElement('div');
      tick.className = 'tick';
      tick.style.left = (100 * x) + '%';
      tick.textContent = tickText(t, step);
      axis.appendChild(tick);
    }
    for (const [bar, s] of bars) {
      bar.style.left = (100 * (s.start_ms - lo) / width) + '%';
      bar.style.width = (100 * s.dur_ms / width) + '%';
    }
    document.getElementById('reset').style.visibility =
      lo > 0 || hi < total ? 'visible' : 'hidden';
  }
  function setRange(a, b) { lo = Math.max(0, a); hi = Math.min(total, b); draw(); }
  document.getElementById('reset').addEventListener('click', () => setRange(0, total));
  document.addEventListener('keydown', ev => { if (ev.key === 'Escape') setRange(0, total); });
  draw();
  const legend = document.getElementById('legend');
  for (const n of names) {
    const item = document.createElement('span');
    const sw = document.createElement('i');
    sw.style.background = color(n);
    item.appendChild(sw);
    item.appendChild(document.createTextNode(n));
    legend.appendChild(item);
  }
  document.getElementById('summary').textContent =
    data.rows.length + ' rows, ' + bars.length + ' spans, ' + fmt(total) + ' from ' +
    new Date(data.t0_unix_s * 1000).toISOString() + '. Click a bar to zoom, Esc to reset.';
  document.body.dataset.bars = String(bars.length);
  document.body.dataset.rendered = '1';
})();
