// The relaybus dashboard. Plain JavaScript, no dependencies, nothing fetched from elsewhere.
// Every text from the store (topics, payloads, errors) reaches the page through textContent,
// never innerHTML: a topic "<img src=x onerror=...>" shows as those characters.
'use strict';
(function () {
  var $ = function (id) { return document.getElementById(id); };
  var state = { status: '', topic: '', after: null, pages: [], next: null, selected: null };
  var history = [];          // {t, completed, failed} totals, for the chart
  var HISTORY_S = 300;
  var tokenBox = $('token');
  try { tokenBox.value = sessionStorage.getItem('relaybus-token') || ''; } catch (e) {}
  tokenBox.addEventListener('change', function () {
    try { sessionStorage.setItem('relaybus-token', tokenBox.value); } catch (e) {}
  });

  function el(tag, text, cls) {
    var e = document.createElement(tag);
    if (text !== undefined && text !== null) e.textContent = String(text);
    if (cls) e.className = cls;
    return e;
  }
  function clear(node) { while (node.firstChild) node.removeChild(node.firstChild); }
  function fmtTime(t) {
    if (t === null || t === undefined) return '–';
    var d = new Date(t * 1000);
    if (isNaN(d.getTime())) return String(t);   // past the years a Date holds (a run_at of 1e300)
    return d.toISOString().replace('T', ' ').replace(/\.\d+Z$/, 'Z');
  }
  function fmtAge(s) {
    if (!s) return '–';
    if (s < 60) return s.toFixed(1) + ' s';
    if (s < 3600) return (s / 60).toFixed(1) + ' min';
    return (s / 3600).toFixed(1) + ' h';
  }
  function fmtInt(n) { return Number(n || 0).toLocaleString('en-US'); }

  function api(method, path) {
    var headers = {};
    if (method !== 'GET' && tokenBox.value) headers.Authorization = 'Bearer ' + tokenBox.value;
    return fetch(path, { method: method, headers: headers, cache: 'no-store' }).then(function (r) {
      return r.json().catch(function () { return { error: 'HTTP ' + r.status }; })
        .then(function (body) { return { status: r.status, body: body }; });
    });
  }

  // ---- stats, topics and the chart --------------------------------------------------------
  function showStats(s) {
    var d = s.deliveries || {};
    $('n-pending').textContent = fmtInt(d.pending);
    $('n-processing').textContent = fmtInt(d.processing);
    // leases that are over: the worker is gone; a claim takes them over (not "running")
    $('n-stalled').textContent = s.stalled > 0 ? '(' + fmtInt(s.stalled) + ' stalled)' : '';
    // (an estimate on a large PostgreSQL table: said so)
    $('n-completed').textContent = (s.completed_estimated ? '\u2248' : '') + fmtInt(d.completed);
    $('n-completed').title = s.completed_estimated ? 'estimated: the table is too large to count' : '';
    $('n-buried').textContent = fmtInt(d.buried);
    $('n-cancelled').textContent = fmtInt(d.cancelled);
    $('n-due').textContent = fmtInt(s.due);
    $('n-oldest').textContent = fmtAge(s.oldest_due_age);
    $('updated').textContent = 'updated ' + fmtTime(s.time) + (s.read_only ? ' · read-only' : '');
    var tb = $('topics');
    clear(tb);
    (s.topics || []).forEach(function (t) {
      var tr = el('tr');
      tr.appendChild(el('td', t.topic));
      ['pending', 'processing', 'completed', 'buried', 'cancelled'].forEach(function (k) {
        // (null: not counted per topic, the table is large)
        tr.appendChild(el('td', t[k] === null ? '\u2013' : fmtInt(t[k]), 'status-' + k));
      });
      tb.appendChild(tr);
    });
    // The process's own runs when it has dispatchers; else what the store's counts say.
    var src = s.runs ? 'runs of this process' : 'from the store\u2019s counts';
    $('chart-source').textContent = '(' + src + ')';
    var point = s.runs ? { t: s.time, completed: s.runs.completed, failed: s.runs.failed }
                       : { t: s.time, completed: d.completed, failed: d.buried };
    history.push(point);
    while (history.length > 2 && history[history.length - 1].t - history[0].t > HISTORY_S) history.shift();
    drawChart();
  }

  function drawChart() {
    var c = $('chart'), g = c.getContext('2d');
    var w = c.width, h = c.height;
    g.clearRect(0, 0, w, h);
    var rates = [];
    for (var i = 1; i < history.length; i++) {
      var dt = history[i].t - history[i - 1].t;
      if (dt <= 0) continue;
      rates.push({ t: history[i].t,
        completed: Math.max(0, history[i].completed - history[i - 1].completed) / dt,
        failed: Math.max(0, history[i].failed - history[i - 1].failed) / dt });
    }
    var max = 1;
    rates.forEach(function (r) { max = Math.max(max, r.completed, r.failed); });
    g.strokeStyle = '#e6e8ec'; g.fillStyle = '#7a8594'; g.font = '11px sans-serif';
    for (var k = 0; k <= 4; k++) {
      var y = h - 14 - (h - 24) * k / 4;
      g.beginPath(); g.moveTo(40, y); g.lineTo(w, y); g.stroke();
      g.fillText((max * k / 4).toFixed(max < 4 ? 1 : 0), 2, y + 4);
    }
    var now = history.length ? history[history.length - 1].t : 0;
    function line(key, color) {
      g.strokeStyle = color; g.lineWidth = 2; g.beginPath();
      rates.forEach(function (r, j) {
        var x = 40 + (w - 40) * (1 - (now - r.t) / HISTORY_S);
        var y = h - 14 - (h - 24) * r[key] / max;
        if (j === 0) g.moveTo(x, y); else g.lineTo(x, y);
      });
      g.stroke(); g.lineWidth = 1;
    }
    line('completed', '#2e9d4b');
    line('failed', '#c8372d');
    g.fillStyle = '#7a8594';
    g.fillText('-' + HISTORY_S / 60 + ' min', 40, h - 2);
    g.fillText('now', w - 24, h - 2);
  }

  function refreshStats() {
    return api('GET', '/api/stats').then(function (r) {
      if (r.status === 200) showStats(r.body);
      else $('updated').textContent = 'stats: ' + (r.body.error || r.status);
    }).catch(function (e) { $('updated').textContent = 'stats: ' + e; });
  }

  // ---- the list -----------------------------------------------------------------------------
  function listPath() {
    var q = ['limit=50'];
    if (state.status) q.push('status=' + encodeURIComponent(state.status));
    if (state.topic) q.push('topic=' + encodeURIComponent(state.topic));
    if (state.prefix) q.push('topic_prefix=' + encodeURIComponent(state.prefix));
    if (state.key) q.push('key=' + encodeURIComponent(state.key));
    if (state.error) q.push('error=' + encodeURIComponent(state.error));
    if (state.after) q.push('after=' + encodeURIComponent(state.after));
    return '/api/deliveries?' + q.join('&');
  }

  function refreshList() {
    return api('GET', listPath()).then(function (r) {
      var tb = $('rows');
      if (r.status !== 200) { $('list-info').textContent = r.body.error || ('HTTP ' + r.status); return; }
      clear(tb);
      r.body.deliveries.forEach(function (d) {
        var tr = el('tr');
        tr.dataset.id = d.id;
        if (d.id === state.selected) tr.className = 'selected';
        tr.appendChild(el('td', d.id));
        tr.appendChild(el('td', d.topic));
        tr.appendChild(el('td', d.status, 'status-' + d.status));
        tr.appendChild(el('td', d.attempts + '/' + d.max_attempts));
        tr.appendChild(el('td', fmtTime(d.run_at)));
        tr.appendChild(el('td', d.last_error || ''));
        tr.addEventListener('click', function () { openDelivery(d.id, true); });
        tb.appendChild(tr);
      });
      state.next = r.body.next;
      $('next').disabled = !state.next;
      $('first').disabled = !state.after;
      $('list-info').textContent = r.body.deliveries.length + ' shown' +
        (state.pages.length ? ' (page ' + (state.pages.length + 1) + ')' : '') + filterNames();
    }).catch(function (e) { $('list-info').textContent = String(e); });
  }

  // What the list shows, in words: the filter it applies.
  function filterNames() {
    var parts = [];
    if (state.status) parts.push('status ' + state.status);
    if (state.topic) parts.push('topic \u201c' + state.topic + '\u201d');
    if (state.prefix) parts.push('topic starting \u201c' + state.prefix + '\u201d');
    if (state.key) parts.push('key \u201c' + state.key + '\u201d');
    if (state.error) parts.push('error containing \u201c' + state.error + '\u201d');
    return parts.length ? ' \u00b7 ' + parts.join(', ') : ' \u00b7 no filter';
  }

  $('filter').addEventListener('submit', function (ev) {
    ev.preventDefault();
    state.status = $('filter-status').value;
    state.topic = $('filter-topic').value;
    state.prefix = $('filter-prefix').value;
    state.key = $('filter-key').value;
    state.error = $('filter-error').value;
    disarmBulk();
    state.after = null; state.pages = [];
    refreshList();
  });
  $('next').addEventListener('click', function () {
    if (!state.next) return;
    state.pages.push(state.after); state.after = state.next; refreshList();
  });
  $('first').addEventListener('click', function () { state.after = null; state.pages = []; refreshList(); });

  // ---- one delivery -------------------------------------------------------------------------
  function pretty(text) {
    try { return JSON.stringify(JSON.parse(text), null, 2); } catch (e) { return text; }
  }

  // A delivery's permalink: the page's own URL with #delivery=ID, which opens it on load.
  function permalink(id) { return '#delivery=' + encodeURIComponent(id); }
  function openDelivery(id, scroll) {
    state.selected = id;
    if (location.hash !== permalink(id)) window.history.replaceState(null, '', permalink(id));
    return api('GET', '/api/deliveries/' + encodeURIComponent(id)).then(function (r) {
      var box = $('detail');
      box.hidden = false;
      $('detail-id').textContent = id;
      $('detail-link').setAttribute('href', permalink(id));
      // opened from the list or the id box: show it where the operator is looking
      if (scroll) box.scrollIntoView({ block: 'nearest' });
      var dl = $('detail-fields');
      clear(dl);
      if (r.status !== 200) { dl.appendChild(el('dd', r.body.error || ('HTTP ' + r.status))); return; }
      var d = r.body;
      var fields = [['topic', d.topic], ['status', d.status], ['attempts', d.attempts + ' of ' + d.max_attempts],
        ['fence', d.fence], ['run at', fmtTime(d.run_at)], ['created', fmtTime(d.created_at)],
        ['lease expires', fmtTime(d.lease_expires_at)], ['settled', fmtTime(d.settled_at)],
        ['key', d.key === null ? '–' : d.key],
        ['group', d.group === null || d.group === undefined ? '–' : d.group],
        ['progress', d.progress === null || d.progress === undefined ? '–' : JSON.stringify(d.progress)],
        ['last error', d.last_error === null ? '–' : d.last_error]];
      fields.forEach(function (f) {
        dl.appendChild(el('dt', f[0]));
        var dd = el('dd', f[1]);
        if (f[0] === 'status') { dd.id = 'detail-status'; dd.className = 'status-' + d.status; }
        dl.appendChild(dd);
      });
      $('detail-payload').textContent = pretty(d.payload);
      // each attempt's error with its time, oldest first; a stack trace keeps its lines
      var errs = $('detail-errors');
      clear(errs);
      (Array.isArray(d.errors) ? d.errors : []).forEach(function (e) {
        var li = el('li');
        li.appendChild(el('span', 'attempt ' + e.attempt + ', ' + fmtTime(e.at), 'muted'));
        li.appendChild(el('pre', String(e.error)));
        errs.appendChild(li);
      });
      $('detail-errors-none').hidden = errs.children.length > 0;
      var live = d.status === 'pending' || d.status === 'processing';
      $('btn-kick').disabled = !(d.status === 'buried' || d.status === 'cancelled');
      $('btn-bury').disabled = !live;
      $('btn-cancel').disabled = !live;
      $('btn-delete').disabled = !(d.status === 'completed' || d.status === 'buried' ||
                                   d.status === 'cancelled');
    });
  }

  function act(method, path, what) {
    var out = $('action-result');
    out.className = ''; out.textContent = what + '…';
    // resolves to true when the action was done: a refused one leaves the delivery open,
    // with the error beside its buttons
    return api(method, path).then(function (r) {
      var done = r.status === 200;
      if (done) { out.className = 'ok'; out.textContent = what + ': done (' + r.body.count + ')'; }
      else { out.className = 'err'; out.textContent = what + ': ' + (r.body.error || ('HTTP ' + r.status)); }
      var p = [refreshStats(), refreshList()];
      if (state.selected && !(done && method === 'DELETE')) p.push(openDelivery(state.selected));
      return Promise.all(p).then(function () { return done; });
    }).catch(function (e) { out.className = 'err'; out.textContent = what + ': ' + e; return false; });
  }
  function selPath(suffix) { return '/api/deliveries/' + encodeURIComponent(state.selected) + suffix; }
  $('btn-kick').addEventListener('click', function () { act('POST', selPath('/kick'), 'kick'); });
  $('btn-bury').addEventListener('click', function () { act('POST', selPath('/bury'), 'bury'); });
  $('btn-cancel').addEventListener('click', function () { act('POST', selPath('/cancel'), 'cancel'); });
  $('btn-delete').addEventListener('click', function () {
    act('DELETE', selPath(''), 'delete').then(function (done) {
      if (done) {
        $('detail').hidden = true;
        state.selected = null;
        window.history.replaceState(null, '', location.pathname + location.search);
      }
    });
  });
  // Bulk actions, on the applied status and topic filters (every topic without one): kick
  // every buried one, cancel every live one, delete every settled one of the status. Each asks
  // first, on the page: the first click names what it will do, a second within 5 s does it.
  // A search (prefix, key, error text) is not theirs to take: they wait until it is cleared.
  function ofTopic() { return state.topic ? ' of topic \u201c' + state.topic + '\u201d' : ''; }
  function topicArg() { return state.topic ? 'topic=' + encodeURIComponent(state.topic) : ''; }
  function searching() { return !!(state.prefix || state.key || state.error); }
  var bulk = {
    'kick-all': {
      usable: function () { return !searching(); },
      label: function () { return 'kick all buried' + ofTopic(); },
      send: function (what) {
        act('POST', '/api/deliveries/kick?status=buried' + (state.topic ? '&' + topicArg() : ''), what);
      }
    },
    'cancel-all': {
      usable: function () {
        return !searching() && (!state.status || state.status === 'pending' || state.status === 'processing');
      },
      label: function () { return 'cancel all ' + (state.status || 'pending and processing') + ofTopic(); },
      send: function (what) {
        var q = [state.status ? 'status=' + state.status : '', topicArg()].filter(Boolean).join('&');
        act('POST', '/api/deliveries/cancel' + (q ? '?' + q : ''), what);
      }
    },
    'delete-all': {
      usable: function () {
        return !searching() && ['completed', 'buried', 'cancelled'].indexOf(state.status) >= 0;
      },
      label: function () { return 'delete all ' + (state.status || 'settled') + ofTopic(); },
      send: function (what) {
        act('DELETE', '/api/deliveries?status=' + state.status + (state.topic ? '&' + topicArg() : ''), what);
      }
    }
  };
  var armed = {};
  function disarm(id) {
    if (armed[id]) clearTimeout(armed[id]);
    armed[id] = null;
    var b = bulk[id], button = $(id);
    button.textContent = b.label();
    button.classList.remove('armed');
    button.disabled = !b.usable();
    button.title = button.disabled ? (searching() ? 'a bulk action takes the status and topic filters only: clear the search'
                                                  : 'not for this status') : '';
  }
  function disarmBulk() { Object.keys(bulk).forEach(disarm); }
  Object.keys(bulk).forEach(function (id) {
    $(id).addEventListener('click', function () {
      var b = bulk[id];
      if (!b.usable()) return;
      if (!armed[id]) {
        disarmBulk();
        $(id).textContent = 'confirm: ' + b.label() + '?';
        $(id).classList.add('armed');
        armed[id] = setTimeout(function () { disarm(id); }, 5000);
        return;
      }
      var what = b.label();
      disarm(id);
      b.send(what);
    });
  });
  disarmBulk();

  // ---- schedules ------------------------------------------------------------------------------
  function fmtEvery(s) {
    if (typeof s !== 'number') return '–';
    if (s < 60) return s + ' s';
    if (s < 3600) return Math.floor(s / 60) + ' min' + (s % 60 ? ' ' + (s % 60) + ' s' : '');
    return (s / 3600).toFixed(s % 3600 ? 1 : 0) + ' h';
  }
  function refreshSchedules() {
    return api('GET', '/api/schedules').then(function (r) {
      var tb = $('schedules');
      clear(tb);
      var list = r.status === 200 ? r.body.schedules || [] : [];
      $('schedules-none').textContent = r.status === 200 ? 'none'
        : 'schedules: ' + (r.body.error || r.status);
      $('schedules-none').hidden = list.length > 0;
      list.forEach(function (sc) {
        var tr = el('tr');
        tr.appendChild(el('td', sc.name));
        tr.appendChild(el('td', sc.topic));
        tr.appendChild(el('td', sc.cron ? 'cron ' + sc.cron + (sc.timezone ? ' (' + sc.timezone + ')' : '')
                                        : 'every ' + fmtEvery(sc.every)));
        tr.appendChild(el('td', fmtTime(sc.next_at)));
        tr.appendChild(el('td', fmtTime(sc.fired_at)));
        tb.appendChild(tr);
      });
    }).catch(function (e) { $('schedules-none').textContent = 'schedules: ' + e; });
  }

  // ---- refresh --------------------------------------------------------------------------------
  function tick() {
    if ($('auto').checked && !document.hidden) { refreshStats(); refreshList(); refreshSchedules(); }
  }
  $('open-id').addEventListener('submit', function (ev) {
    ev.preventDefault();
    var id = $('open-id-input').value.trim();
    if (id) openDelivery(id, true);
  });
  function openFromHash() {
    var m = /^#delivery=(.+)$/.exec(location.hash);
    var id = null;
    try { id = m && decodeURIComponent(m[1]); } catch (e) { id = null; }   // (a bad %-escape)
    if (id) openDelivery(id, true);
  }
  window.addEventListener('hashchange', openFromHash);
  refreshStats(); refreshList(); refreshSchedules(); openFromHash();
  setInterval(tick, 2000);
})();
