// Issue 14 parity items 3, 5, 6 and 8 with the official e2b JS SDK (2.51.0): the same
// expectations as tests/envd/parity_checks.py (which names the E2B envd Go code each
// comes from). Everything is set up through the SDK (commands.run as the default user), so
// the script runs against envd on the host (tests/envd/test_parity_envd.py, E2B_DEBUG +
// E2B_SANDBOX_URL) and against a sandbox VM (tests/e2e/test_parity_envd.py, mode B env).
// Usage: node parity.mjs <scratch dir, made here> <directory under / that does not exist>.
// Prints `ok <check>` or `FAIL <check>` per check, then `all ok` or exits non-zero.
import assert from 'node:assert/strict'
import { Readable } from 'node:stream'
import { Sandbox } from 'e2b'

const [base, top] = process.argv.slice(2)
assert.ok(base && top, 'usage: node parity.mjs <scratch dir> <new top-level dir>')
const slow = process.env.PARITY_SLOW === '1' // a VM under TCG: wait longer
const waitMs = slow ? 60_000 : 10_000
const settleMs = slow ? 2_000 : 500
const sbx = await Sandbox.create({ timeoutMs: 600_000 })
// a real sandbox (VM) is ours to kill; in debug mode the "sandbox" is envd on this host
const owned = process.env.E2B_DEBUG !== 'true'
const sleep = (ms) => new Promise((r) => setTimeout(r, ms))
const until = async (pred, ms = waitMs) => {
  const end = Date.now() + ms
  while (!pred()) {
    if (Date.now() > end) return false
    await sleep(50)
  }
  return true
}
const sh = async (cmd, opts) => (await sbx.commands.run(cmd, opts)).stdout
let failed = 0
const check = async (name, fn) => {
  try {
    await fn()
    console.log(`ok ${name}`)
  } catch (err) {
    console.log(`FAIL ${name}`)
    console.error(`FAIL ${name}: ${err?.stack ?? err}`)
    failed += 1
  }
}

await sh(`mkdir -p ${base}`)

// ---- item 3: a symlink reports its target's type; unresolvable ones are dropped by list
await check('symlinks', async () => {
  const d = `${base}/js-links`
  const f = `${d}/f.txt`
  await sh(`mkdir -p ${d}/sub && cd ${d} && printf hello > f.txt && chmod 640 f.txt && ` +
    `chmod 751 sub && printf in > sub/inner.txt && ln -s ${f} abs && ln -s f.txt rel && ` +
    'ln -s sub dirlink && ln -s missing dangling && ln -s rel chain && ' +
    'ln -s loop2 loop1 && ln -s loop1 loop2')
  const links = {
    abs: ['file', f, 0o640, f.length],
    rel: ['file', f, 0o640, 'f.txt'.length],
    chain: ['file', f, 0o640, 'rel'.length],
    dirlink: ['dir', `${d}/sub`, 0o751, 'sub'.length],
  }
  for (const [name, [type, target, mode, size]] of Object.entries(links)) {
    const i = await sbx.files.getInfo(`${d}/${name}`)
    assert.deepEqual([i.name, i.path, i.type, i.symlinkTarget, i.mode, i.permissions, i.size],
      [name, `${d}/${name}`, type, target, mode, 'Lrwxrwxrwx', size], name)
  }
  for (const name of ['dangling', 'loop1']) {
    const i = await sbx.files.getInfo(`${d}/${name}`)
    assert.deepEqual([i.type, i.symlinkTarget, i.mode], [undefined, `${d}/${name}`, 0], name)
  }
  const listed = Object.fromEntries((await sbx.files.list(d)).map((e) => [e.name, e]))
  assert.deepEqual(Object.keys(listed).sort(), ['abs', 'chain', 'dirlink', 'f.txt', 'rel', 'sub'])
  for (const [name, [type, target]] of Object.entries(links)) {
    assert.deepEqual([listed[name].type, listed[name].symlinkTarget], [type, target], name)
  }
  const deep = (await sbx.files.list(d, { depth: 2 })).map((e) => e.path)
  assert.ok(deep.includes(`${d}/sub/inner.txt`) && !deep.includes(`${d}/dirlink/inner.txt`))
})

// ---- item 5: E2B's event sequences, streaming watchDir
const byName = (events, name) => events.filter((e) => e[0] === name).map((e) => e[1])
for (const recursive of [false, true]) {
  await check(`watch ${recursive ? 'recursive' : 'flat'}`, async () => {
    const w = `${base}/js-watch-${recursive ? 'rec' : 'flat'}`
    await sh(`mkdir -p ${w} && cd ${w} && printf 1 > old.txt && printf 1 > r1.txt && ` +
      'printf 1 > c.txt && printf 1 > x.txt')
    const events = []
    const handle = await sbx.files.watchDir(w, (e) => events.push([e.name, e.type]),
      { recursive, timeoutMs: 0 })
    try {
      await sbx.files.write(`${w}/new.txt`, 'hello')
      await sbx.files.write(`${w}/old.txt`, 'hello again')
      await sbx.files.rename(`${w}/r1.txt`, `${w}/r2.txt`)
      await sh(`chmod 600 ${w}/c.txt`)
      await sbx.files.remove(`${w}/x.txt`)
      await sh(`mkdir -p ${w}/n1/n2/n3 && printf x > ${w}/n1/n2/n3/f.txt`)
      const nested = recursive ? ['n1', 'n1/n2', 'n1/n2/n3', 'n1/n2/n3/f.txt'] : ['n1']
      assert.ok(await until(() => nested.every((n) => byName(events, n).includes('create'))),
        JSON.stringify(events))
      await sbx.files.write(`${w}/n1/n2/n3/g.txt`, 'g')
      await sh(`chmod 700 ${w}/n1`)
      const expect = {
        'new.txt': ['create', 'chmod', 'write'],
        'old.txt': ['chmod', 'write'],
        'r1.txt': ['rename'],
        'r2.txt': ['create'],
        'c.txt': ['chmod'],
        'x.txt': ['remove'],
        n1: recursive ? ['create', 'chmod', 'chmod'] : ['create', 'chmod'],
      }
      if (recursive) expect['n1/n2/n3/g.txt'] = ['create', 'chmod', 'write']
      assert.ok(await until(() => Object.entries(expect)
        .every(([n, v]) => byName(events, n).length >= v.length)), JSON.stringify(events))
      await sleep(settleMs)
      for (const [name, types] of Object.entries(expect)) {
        assert.deepEqual(byName(events, name), types, `${name}: ${JSON.stringify(events)}`)
      }
      if (!recursive) assert.ok(!events.some((e) => e[0].startsWith('n1/')), JSON.stringify(events))
    } finally {
      await handle.stop()
    }
  })
}

// ---- item 6: after create → disconnect → connect, input shows its output on the new handle
await check('pty reattach', async () => {
  const pty = await sbx.pty.create({ cols: 80, rows: 24, onData: () => {}, timeoutMs: 0 })
  try {
    await pty.disconnect()
    for (const [cmd, wanted] of [['echo hi-$((1+1))\n', 'hi-2'], ['echo again-$((2+2))\n', 'again-4']]) {
      const chunks = []
      const again = await sbx.pty.connect(pty.pid, { onData: (d) => chunks.push(Buffer.from(d)), timeoutMs: 0 })
      await sbx.pty.sendInput(pty.pid, new TextEncoder().encode(cmd))
      const text = () => Buffer.concat(chunks).toString()
      assert.ok(await until(() => text().includes(wanted)), JSON.stringify(text()))
      await again.disconnect()
    }
  } finally {
    await sbx.pty.kill(pty.pid)
  }
})

// ---- item 8: parents the user cannot make are made (as E2B: by envd, given to the user)
await check('write parents', async () => {
  try {
    const infos = await sbx.files.write([
      { path: `${base}/js-wf/a.txt`, data: 'a' },
      { path: `${top}/x.txt`, data: 'x' },
    ])
    assert.deepEqual(infos.map((i) => i.path), [`${base}/js-wf/a.txt`, `${top}/x.txt`])
    assert.equal(await sbx.files.read(`${top}/x.txt`), 'x')
    assert.equal((await sh(`stat -c %U:%G ${top} ${top}/x.txt`)).trim(), 'user:user\nuser:user')
    const streamed = await sbx.files.write([
      { path: `${top}/deeper/y.txt`, data: Readable.toWeb(Readable.from([Buffer.from('y')])) },
      { path: `${base}/js-wf/b.txt`, data: 'b' },
    ], { useOctetStream: true })
    assert.equal(streamed.length, 2)
    assert.equal(await sbx.files.read(`${top}/deeper/y.txt`), 'y')
  } finally {
    await sh(`rm -rf ${top}`, { user: 'root' })
  }
})

await check('write all-or-nothing', async () => {
  const d = `${base}/js-aon`
  await sh(`mkdir -p ${d} && printf old > ${d}/keep.txt && printf plain > ${d}/plain`)
  const bad = `${d}/plain/x.txt`
  await assert.rejects(sbx.files.write([
    { path: `${d}/new1/a.txt`, data: 'a' },
    { path: `${d}/keep.txt`, data: 'new' },
    { path: bad, data: 'x' },
  ]), (err) => err.message.includes(bad))
  assert.deepEqual((await sbx.files.list(d)).map((e) => e.name).sort(), ['keep.txt', 'plain'])
  assert.equal(await sbx.files.read(`${d}/keep.txt`), 'old')
})

if (owned) await sbx.kill().catch(() => {})
if (failed) process.exit(1)
console.log('all ok')
