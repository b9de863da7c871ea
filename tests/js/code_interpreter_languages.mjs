// The per-language battery (tests/code_interpreter/languages.json) through the official
// @e2b/code-interpreter JS SDK: for each language a run and its stdout, state across
// runs, an error with its traceback, env vars at three levels, the cwd of the default
// and of a created context, contexts listed / restarted / removed, streaming callbacks,
// and a run cut by timeoutMs (the kernel interrupted, its state kept).
//
//   node code_interpreter_languages.mjs <home> <other dir> <sandbox var>=<value> [lang...]
//
// Debug mode (E2B_DEBUG=true) reaches a server on localhost:49999 (whose stand-in envd has
// the sandbox variable); otherwise a new sandbox is created through the service with that
// variable, and killed at the end (tests/e2e). Prints one line per passed check, then
// "ALL PASSED" and a JSON summary as the last line; exits non-zero on the first failure.
import assert from 'node:assert/strict'
import { readFileSync } from 'node:fs'
import { Sandbox, TimeoutError } from '@e2b/code-interpreter'

const [home, otherDir, sandboxVar, ...only] = process.argv.slice(2)
const [sbName, sbValue] = sandboxVar.split('=')
const battery = JSON.parse(readFileSync(
  new URL('../code_interpreter/languages.json', import.meta.url), 'utf8'))
const languages = only.length ? only : Object.keys(battery).filter((k) => !k.startsWith('_'))
// the first run of a language may start its kernel (a JVM under TCG takes a while)
const SLOW = { timeoutMs: 600_000, requestTimeoutMs: 600_000 }
const sbx = await Sandbox.create({ envs: { [sbName]: sbValue }, timeoutMs: 1_800_000,
  requestTimeoutMs: 600_000 })
const summary = {}

const fill = (s, vars) => Object.entries(vars).reduce(
  (acc, [k, v]) => acc.replaceAll(`@${k.toUpperCase()}@`, v), s)
const stdout = (execution) => execution.logs.stdout.join('')
const expectOutput = (execution, spec, vars = {}) => {
  assert.equal(execution.error, undefined, `${execution.error?.name}: ${execution.error?.value}`)
  if ('text' in spec) {
    const texts = execution.results.map((r) => r.text).filter((t) => t !== undefined)
    assert.equal(texts[0]?.trim(), fill(spec.text, vars))
  } else {
    assert.equal(stdout(execution), fill(spec.stdout, vars))
  }
}

for (const language of languages) {
  const b = battery[language]
  const check = async (name, fn) => {
    try {
      await fn()
      console.log(`ok ${language} ${name}`)
    } catch (err) {
      console.error(`FAIL ${language} ${name}: ${err?.stack ?? err}`)
      process.exit(1)
    }
  }

  await check('run and state', async () => {
    const hello = await sbx.runCode(b.hello.code, { language, ...SLOW })
    assert.equal(stdout(hello), b.hello.stdout)
    assert.equal((await sbx.runCode(b.state.set, { language })).error, undefined)
    expectOutput(await sbx.runCode(b.state.get, { language }), b.state)
  })

  await check('error and traceback', async () => {
    const seen = []
    const execution = await sbx.runCode(b.error.code, { language, onError: (e) => seen.push(e) })
    const err = execution.error
    assert.ok(err, 'no error')
    assert.deepEqual(seen, [err])
    assert.equal(err.name, b.error.name)
    assert.ok(err.value.includes(b.error.value), err.value)
    assert.ok(err.traceback.includes(b.error.traceback), err.traceback)
    assert.ok(!err.traceback.includes('\x1b['), 'ANSI colours in the traceback')
  })

  await check('env vars: sandbox, per run, overwrite', async () => {
    const read = async (name, expected, envs) => expectOutput(
      await sbx.runCode(fill(b.env.code, { name }), { language, envs }), b.env,
      { value: expected })
    await read('AENV_JS_PER_RUN', 'js per run', { AENV_JS_PER_RUN: 'js per run' })
    await read('AENV_JS_PER_RUN', 'default')
    await read(sbName, sbValue)
    await read(sbName, 'overwritten', { [sbName]: 'overwritten' })
    await read(sbName, sbValue)
  })

  await check('cwd and contexts', async () => {
    expectOutput(await sbx.runCode(b.cwd.code, { language }), b.cwd, { cwd: home })
    const ctx = await sbx.createCodeContext({ language, cwd: otherDir, ...SLOW })
    assert.equal(ctx.language, language)
    assert.equal(ctx.cwd, otherDir)
    try {
      expectOutput(await sbx.runCode(b.cwd.code, { context: ctx }), b.cwd, { cwd: otherDir })
      assert.ok((await sbx.listCodeContexts()).some((c) => c.id === ctx.id))
      await sbx.runCode(b.state.set, { context: ctx })
      expectOutput(await sbx.runCode(b.state.get, { context: ctx }), b.state)
      await sbx.restartCodeContext(ctx)
      const after = await sbx.runCode(b.state.get, { context: ctx, ...SLOW })
      assert.ok(after.error !== undefined || stdout(after) !== b.state.stdout, 'state kept')
    } finally {
      await sbx.removeCodeContext(ctx)
    }
    assert.ok(!(await sbx.listCodeContexts()).some((c) => c.id === ctx.id))
  })

  await check('streaming', async () => {
    const lines = []
    const execution = await sbx.runCode(b.stream.code, {
      language, onStdout: (m) => lines.push(m.line) })
    assert.equal(execution.error, undefined)
    assert.equal(lines.join(''), b.stream.stdout.join(''))
  })

  await check('timeout interrupts', async () => {
    await sbx.runCode(b.state.set, { language })
    await assert.rejects(sbx.runCode(b.sleep, { language, timeoutMs: 3000 }),
      (err) => err instanceof TimeoutError)
    expectOutput(await sbx.runCode(b.state.get, { language }), b.state)
  })
  summary[language] = true
}

if (process.env.E2B_DEBUG !== 'true') await sbx.kill()
console.log('ALL PASSED')
console.log(JSON.stringify(summary))
