// Drives a code-interpreter server (templates/code-interpreter/server) with the official
// @e2b/code-interpreter JS SDK. Two callers:
//  - tests/code_interpreter/test_js_sdk.py: debug mode (E2B_DEBUG=true: the SDK calls
//    http://localhost:49999, no API call), `node code_interpreter.mjs <dir>` with <dir> a
//    host directory the server's kernels can see (context cwd, streaming marker file);
//  - tests/e2e/test_code_interpreter.py: a real sandbox of code-interpreter-v1 through
//    the service (E2B_API_URL / E2B_SANDBOX_URL / E2B_DOMAIN), no argument: the marker
//    is written into the guest with sbx.files and contexts use /tmp.
// Prints one line per passed check, then "ALL PASSED" and a JSON summary as the last
// line; exits non-zero on the first failure.
import assert from 'node:assert/strict'
import { writeFileSync } from 'node:fs'
import { Sandbox, NotFoundError, TimeoutError } from '@e2b/code-interpreter'

const dir = process.argv[2]
const sbx = await Sandbox.create()
const summary = {}
const check = async (name, fn) => {
  try {
    await fn()
    console.log(`ok ${name}`)
  } catch (err) {
    console.error(`FAIL ${name}: ${err?.stack ?? err}`)
    process.exit(1)
  }
}

await check('state and text', async () => {
  await sbx.runCode('js_x = 41')
  const execution = await sbx.runCode('js_x + 1')
  assert.equal(execution.text, '42')
  assert.equal(execution.results[0].isMainResult, true)
  assert.deepEqual(execution.results[0].formats(), [])   // text only, nothing in extra
  assert.equal(typeof execution.executionCount, 'number')
  summary.answer = execution.text
})

await check('matplotlib png', async () => {
  const execution = await sbx.runCode(
    'import matplotlib.pyplot as plt\nplt.plot([1, 2, 3])\nplt.show()')
  const pngs = execution.results.filter((r) => r.png)
  assert.equal(pngs.length, 1)
  assert.equal(pngs[0].isMainResult, false)
  const bytes = Buffer.from(pngs[0].png, 'base64')
  assert.deepEqual([...bytes.subarray(0, 8)], [0x89, 0x50, 0x4e, 0x47, 0x0d, 0x0a, 0x1a, 0x0a])
  summary.png = true
})

await check('error', async () => {
  const seen = []
  const execution = await sbx.runCode('def f():\n    raise ValueError("js boom")\nf()',
    { onError: (e) => seen.push(e) })
  assert.equal(execution.error.name, 'ValueError')
  assert.equal(execution.error.value, 'js boom')
  assert.match(execution.error.traceback, /raise ValueError\("js boom"\)/)
  assert.equal(seen.length, 1)
  summary.errorName = execution.error.name
})

await check('onStdout streams while the code runs', async () => {
  // the code only prints "marker seen" if the callback made the marker while it ran
  const marker = dir ? `${dir}/js-first-line` : `/tmp/js-first-line-${Date.now()}`
  const touch = dir ? async () => writeFileSync(marker, '') : () => sbx.files.write(marker, '')
  const events = []
  const code = `import os, time\nprint('first', flush=True)\n` +
    `for _ in range(1200):\n    if os.path.exists(${JSON.stringify(marker)}): break\n` +
    `    time.sleep(0.05)\nprint('marker seen' if os.path.exists(${JSON.stringify(marker)}) else 'no marker')`
  await sbx.runCode(code, {
    onStdout: async (m) => { events.push(m.line); await touch() },
  })
  events.push('returned')
  // the kernel may deliver a line in more than one stream message: compare the text
  assert.equal(events.pop(), 'returned')
  assert.equal(events.join(''), 'first\nmarker seen\n')
  summary.streamed = true
})

await check('envs for one run', async () => {
  const code = 'import os\nprint(os.environ.get("JS_RUN_VAR"))'
  const during = await sbx.runCode(code, { envs: { JS_RUN_VAR: 'set' } })
  assert.equal(during.logs.stdout.join(''), 'set\n')
  const after = await sbx.runCode(code)
  assert.equal(after.logs.stdout.join(''), 'None\n')
})

await check('timeout interrupts the kernel', async () => {
  await sbx.runCode('js_kept = "yes"')
  await assert.rejects(sbx.runCode('import time; time.sleep(60)', { timeoutMs: 2000 }),
    (err) => err instanceof TimeoutError)
  const after = await sbx.runCode('js_kept')
  assert.equal(after.error, undefined)
  assert.equal(after.text, 'yes')
  summary.interrupted = true
})

await check('contexts', async () => {
  const cwd = dir ?? '/tmp'
  const ctx = await sbx.createCodeContext({ cwd })
  assert.equal(ctx.language, 'python')
  assert.equal(ctx.cwd, cwd)
  assert.equal((await sbx.runCode('import os; os.getcwd()', { context: ctx })).text, cwd)
  await sbx.runCode('ctx_only = 1', { context: ctx })
  const other = await sbx.runCode('ctx_only')
  assert.equal(other.error.name, 'NameError')
  assert.ok((await sbx.listCodeContexts()).some((c) => c.id === ctx.id))
  await sbx.restartCodeContext(ctx)
  assert.equal((await sbx.runCode('ctx_only', { context: ctx })).error.name, 'NameError')
  await sbx.removeCodeContext(ctx.id)
  assert.ok(!(await sbx.listCodeContexts()).some((c) => c.id === ctx.id))
  await assert.rejects(sbx.runCode('1', { context: ctx }), (err) => err instanceof NotFoundError)
  summary.isolated = true
})

await sbx.kill()   // a no-op in debug mode
console.log('ALL PASSED')
console.log(JSON.stringify(summary))
// The SDK leaves its request-timeout timer armed when a request fails with an HTTP
// error (the NotFoundError above): without this the process lingers for requestTimeoutMs.
process.exit(0)
