// browser.js URL TOKEN OUTDIR -- drives the dashboard in headless Chromium (playwright-core,
// Debian's /usr/bin/chromium): the counts show, an XSS topic stays text, filter to buried,
// open one, kick it with the token, see it pending, cancel it. Screenshots go to OUTDIR. Prints one JSON
// line with what it saw; exits non-zero on any failure.
'use strict';
const { chromium } = require('playwright-core');
const [url, token, outdir] = process.argv.slice(2);
const result = { steps: [] };
const errors = [];      // scripts' errors on the pages, reported with a failure too
(async () => {
  const browser = await chromium.launch({
    executablePath: process.env.RELAYBUS_CHROMIUM || '/usr/bin/chromium',
    args: ['--headless', '--no-sandbox', '--disable-gpu', '--disable-background-networking'],
  });
  try {
    const page = await browser.newPage({ viewport: { width: 1280, height: 1000 } });
    const dialogs = [];
    page.on('dialog', (d) => { dialogs.push(d.message()); d.dismiss(); });
    const external = [];
    page.on('request', (r) => { if (!r.url().startsWith(url)) external.push(r.url()); });
    page.on('pageerror', (e) => errors.push(String(e)));
    await page.goto(url);
    await page.waitForFunction(() => document.getElementById('n-buried').textContent.trim() === '3');
    await page.waitForFunction(() => document.querySelectorAll('#rows tr').length > 0);
    await page.waitForFunction(() => document.getElementById('n-processing').textContent.trim() === '1');
    result.counts = await page.evaluate(() => ['pending', 'processing', 'completed', 'buried']
      .map((k) => [k, document.getElementById('n-' + k).textContent]));
    result.xss_text = await page.evaluate(() => Array.from(document.querySelectorAll('#topics td'))
      .some((td) => td.textContent === '<img src=x onerror=alert(1)>'));
    await page.waitForFunction(() => document.querySelectorAll('#schedules tr').length === 2);
    result.schedules = await page.evaluate(() => Array.from(document.querySelectorAll('#schedules tr'))
      .map((tr) => Array.from(tr.children).slice(0, 3).map((td) => td.textContent)));
    result.images = await page.evaluate(() => document.querySelectorAll('img').length);
    await page.waitForTimeout(2500);         // a few refreshes for the chart
    await page.screenshot({ path: outdir + '/dashboard.png', fullPage: true });
    result.steps.push('overview');

    await page.selectOption('#filter-status', 'buried');
    await page.click('#apply');
    await page.waitForFunction(() => {
      const rows = Array.from(document.querySelectorAll('#rows tr'));
      return rows.length === 3 && rows.every((r) => r.children[2].textContent === 'buried');
    });
    result.steps.push('filtered');
    const id = await page.getAttribute('#rows tr:first-child', 'data-id');
    result.id = id;
    await page.click('#rows tr:first-child');
    await page.waitForFunction(() => { const s = document.getElementById('detail-status'); return s && s.textContent === 'buried'; });
    result.payload = await page.textContent('#detail-payload');
    result.last_error = await page.evaluate(() => {
      const dts = Array.from(document.querySelectorAll('#detail-fields dt'));
      const i = dts.findIndex((d) => d.textContent === 'last error');
      return i >= 0 ? dts[i].nextElementSibling.textContent : null;
    });
    result.errors_listed = await page.evaluate(() => Array.from(document.querySelectorAll('#detail-errors li pre'))
      .map((p) => p.textContent));
    result.hash = await page.evaluate(() => location.hash);
    await page.screenshot({ path: outdir + '/dashboard-detail.png', fullPage: true });
    result.steps.push('opened');

    // without the token the kick is refused and says so
    await page.click('#btn-kick');
    await page.waitForFunction(() => document.getElementById('action-result').className === 'err');
    result.without_token = await page.textContent('#action-result');
    // a refused delete keeps the delivery open and says why (it used to hide both: the kick
    // below then found no button)
    await page.click('#btn-delete');
    await page.waitForFunction(() => (document.getElementById('action-result').textContent || '').startsWith('delete: '));
    result.delete_refused = await page.textContent('#action-result');
    result.detail_shown = await page.isVisible('#action-result');
    await page.fill('#token', token);
    await page.dispatchEvent('#token', 'change');
    await page.click('#btn-kick');
    await page.waitForFunction(() => document.getElementById('action-result').className !== '');
    result.with_token = await page.textContent('#action-result');
    await page.waitForFunction(() => document.getElementById('detail-status').textContent === 'pending');
    result.after_kick = await page.textContent('#detail-status');
    await page.screenshot({ path: outdir + '/dashboard-kicked.png', fullPage: true });
    result.steps.push('kicked');
    // the kicked delivery is pending: cancel it, and the detail says cancelled
    result.cancel_enabled = await page.isEnabled('#btn-cancel');
    await page.click('#btn-cancel');
    await page.waitForFunction(() => document.getElementById('detail-status').textContent === 'cancelled');
    result.cancelled = await page.textContent('#action-result');
    result.kick_enabled_after = await page.isEnabled('#btn-kick');
    await page.waitForFunction(() => document.getElementById('n-cancelled').textContent.trim() === '1');
    await page.screenshot({ path: outdir + '/dashboard-cancelled.png', fullPage: true });
    result.steps.push('cancelled');

    // "kick all buried" takes the topic filter and asks first: a topic with none kicks none
    // and leaves the others buried; then the one topic with buried deliveries
    async function kickAll(topic) {
      await page.fill('#filter-topic', topic);
      await page.click('#apply');
      await page.click('#kick-all');
      const asked = await page.textContent('#kick-all');
      const before = await page.textContent('#n-buried');
      await page.waitForTimeout(300);
      const untouched = (await page.textContent('#n-buried')) === before;
      await page.click('#kick-all');
      await page.waitForFunction(() => /: (done|this)/.test(document.getElementById('action-result').textContent));
      return { asked, untouched, said: await page.textContent('#action-result') };
    }
    result.kick_other = await kickAll('no.such.topic');
    result.buried_after_other = await page.textContent('#n-buried');
    result.kick_topic = await kickAll('payments.charge');
    await page.waitForFunction(() => document.getElementById('n-buried').textContent.trim() === '0');
    await page.screenshot({ path: outdir + '/dashboard-kick-topic.png', fullPage: true });
    result.steps.push('kicked topic');

    // cancel all and delete all take the status and topic filters, and ask first
    async function bulk(button, status, topic) {
      await page.selectOption('#filter-status', status);
      await page.fill('#filter-topic', topic);
      await page.click('#apply');
      await page.click(button);
      const asked = await page.textContent(button);
      await page.click(button);
      await page.waitForFunction(() => /: (done|this)/.test(document.getElementById('action-result').textContent));
      return { asked, said: await page.textContent('#action-result') };
    }
    await page.selectOption('#filter-status', 'pending');
    await page.click('#apply');
    result.delete_disabled_for_pending = await page.isDisabled('#delete-all');
    result.cancel_pending = await bulk('#cancel-all', 'pending', 'email.send');
    await page.waitForFunction(() => document.querySelectorAll('#rows tr').length === 0);
    result.delete_cancelled = await bulk('#delete-all', 'cancelled', 'email.send');
    await page.fill('#filter-prefix', 'email');
    await page.click('#apply');
    result.bulk_disabled_when_searching = await page.isDisabled('#cancel-all') && await page.isDisabled('#kick-all');
    await page.fill('#filter-prefix', '');
    await page.selectOption('#filter-status', '');
    await page.fill('#filter-topic', '');
    await page.click('#apply');
    await page.screenshot({ path: outdir + '/dashboard-bulk.png', fullPage: true });
    result.steps.push('bulk');

    // the id box opens one delivery; its permalink opens it in a new page
    await page.fill('#open-id-input', id);
    await page.click('#open-id button');
    await page.waitForFunction((want) => document.getElementById('detail-id').textContent === want, id);
    const link = await page.getAttribute('#detail-link', 'href');
    const other = await browser.newPage({ viewport: { width: 1280, height: 1000 } });
    other.on('pageerror', (e) => errors.push(String(e)));
    await other.goto(url + link);
    await other.waitForFunction((want) => {
      const s = document.getElementById('detail-status');
      return document.getElementById('detail-id').textContent === want && s && s.textContent !== '';
    }, id);
    result.permalink = link;
    result.permalink_status = await other.textContent('#detail-status');
    result.permalink_visible = await other.isVisible('#detail');
    await other.close();
    const bad = await browser.newPage();
    bad.on('pageerror', (e) => errors.push(String(e)));
    await bad.goto(url + '#delivery=%E0%A4%A');          // a bad escape: nothing opens, nothing breaks
    await bad.waitForFunction(() => document.querySelectorAll('#rows tr').length > 0);
    result.bad_hash_hidden = await bad.isHidden('#detail');
    await bad.close();
    result.steps.push('permalink');
    result.dialogs = dialogs;
    result.external = external;
    result.errors = errors;
    console.log(JSON.stringify(result));
  } finally {
    await browser.close();
  }
})().catch((e) => { console.log(JSON.stringify(Object.assign(result, { failure: String(e), errors }))); process.exit(1); });
