// Drives envd's process.Process with the official e2b JS SDK (E2B_DEBUG=true; E2B_SANDBOX_URL when not on :49983).
// Run from pytest (tests/envd/test_process_js.py); prints one line per passed check and
// exits non-zero on the first failure.
import assert from 'node:assert/strict'
import { Sandbox, CommandExitError } from 'e2b'

const sbx = await Sandbox.create()
const started = []
const check = async (name, fn) => {
  try {
    await fn()
    console.log(`ok ${name}`)
  } catch (err) {
    console.error(`FAIL ${name}: ${err?.stack ?? err}`)
    for (const pid of started) await sbx.commands.kill(pid).catch(() => {})
    process.exit(1)
  }
}
const sleep = (ms) => new Promise((r) => setTimeout(r, ms))

await check('run', async () => {
  const r = await sbx.commands.run('echo hi; echo err >&2')
  assert.equal(r.stdout, 'hi\n')
  assert.equal(r.stderr, 'err\n')
  assert.equal(r.exitCode, 0)
})

await check('stream', async () => {
  const t0 = Date.now()
  const seen = []
  await sbx.commands.run('for i in 1 2 3; do echo $i; sleep 0.3; done', {
    onStdout: (d) => seen.push([Date.now() - t0, d]),
  })
  assert.equal(seen.map((s) => s[1]).join(''), '1\n2\n3\n')
  // streamed as printed (0.3 s apart), not buffered until the end
  assert.ok(seen.at(-1)[0] - seen[0][0] > 400, `chunks not spread out: ${JSON.stringify(seen)}`)
})

await check('exit code', async () => {
  await assert.rejects(sbx.commands.run('echo bad >&2; exit 3'), (err) => {
    assert.ok(err instanceof CommandExitError, String(err))
    assert.equal(err.exitCode, 3)
    assert.equal(err.stderr, 'bad\n')
    return true
  })
})

await check('background + sendStdin + closeStdin', async () => {
  const h = await sbx.commands.run('cat', { background: true, stdin: true })
  started.push(h.pid)
  await sbx.commands.sendStdin(h.pid, 'abc\n')
  await sbx.commands.sendStdin(h.pid, 'def\n')
  await sbx.commands.closeStdin(h.pid)
  const r = await h.wait()
  assert.equal(r.stdout, 'abc\ndef\n')
})

await check('list + connect + kill', async () => {
  const h = await sbx.commands.run('sleep 30', { background: true })
  started.push(h.pid)
  const list = await sbx.commands.list()
  const mine = list.find((p) => p.pid === h.pid)
  assert.ok(mine, 'background process not listed')
  assert.deepEqual(mine.args, ['-l', '-c', 'sleep 30'])
  const other = await sbx.commands.connect(h.pid)
  assert.equal(await sbx.commands.kill(h.pid), true)
  await assert.rejects(other.wait(), (err) => err.exitCode === -1 && /signal: killed/.test(err.error))
  await assert.rejects(h.wait(), CommandExitError)
  assert.equal(await sbx.commands.kill(h.pid), false)
  assert.equal(await sbx.commands.kill(987654), false)
})

await check('timeout', async () => {
  const t0 = Date.now()
  await assert.rejects(sbx.commands.run('sleep 10', { timeoutMs: 1000 }), (err) => err.name === 'TimeoutError')
  assert.ok(Date.now() - t0 < 4000)
})

await check('pty', async () => {
  const chunks = []
  const pty = await sbx.pty.create({ cols: 80, rows: 24, onData: (d) => chunks.push(Buffer.from(d)) })
  started.push(pty.pid)
  await sbx.pty.resize(pty.pid, { cols: 101, rows: 37 })
  await sbx.pty.sendInput(pty.pid, new TextEncoder().encode('stty size\n'))
  const deadline = Date.now() + 10000
  while (!Buffer.concat(chunks).includes('37 101') && Date.now() < deadline) await sleep(50)
  assert.ok(Buffer.concat(chunks).includes('37 101'), Buffer.concat(chunks).toString())
  assert.equal(await sbx.pty.kill(pty.pid), true)
  await pty.wait().catch(() => {})
})

console.log('all ok')
