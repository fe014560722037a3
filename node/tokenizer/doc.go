// Package tokenizer turns prompt text into token IDs: a byte tokenizer for
// tests and AIBrix-style character mode, a real BPE tokenizer (tiktoken
// cl100k_base, loaded offline) whose counts look like a real model's, and a
// model's own Hugging Face tokenizer (HF, "hf:<dir>") whose ids are the
// engine's.
//
// Contract:
//
//   - New(name) returns a Tokenizer: "bytes"/"character" (Bytes),
//     "tiktoken"/"cl100k_base" (*Tiktoken, vocabulary loaded once, lazily,
//     and shared) or "hf:<dir>" (*HF, LoadHF, loaded once per directory).
//     Unknown names wrap ErrUnknownTokenizer.
//   - HF reproduces byte-level BPE tokenizer.json files (Qwen2/2.5/3, Llama
//     3.x, DeepSeek V3) exactly as vLLM applies them, refusing (ErrUnsupported) any
//     component it does not: Encode recognizes added tokens and adds no
//     special tokens, EncodeSpecial adds the post-processor's, RenderChat
//     renders the model's chat template as vLLM passes messages.
//     hf_diff_test.go compares every id with @huggingface/tokenizers and
//     @huggingface/jinja (npm, testdata/hfref) on a generated corpus.
//   - EncodeLimited bounds the work per prompt (Limit: tokens, piece
//     length); its result is always a prefix of Encode's.
//   - Every Tokenizer and Decoder here is safe for concurrent use, never
//     blocks on I/O after New returns, and never keeps its input.
//     Encode appends to dst, so callers can reuse buffers.
//   - Encode is a pure function of the text: the same text always gives the
//     same tokens. Special-token text ("<|endoftext|>") is ordinary text.
//   - The tiktoken tokenizer returns exactly tiktoken-go's EncodeOrdinary
//     tokens, computed by a native scanner and BPE (fast.go) about 50x
//     faster; tests compare the two on random, Unicode and seed texts.
//   - Cached (NewCached) wraps Bytes, the tiktoken tokenizer or an HF with a
//     bytes-bounded LRU cache of tokenized prefixes. Its output is token
//     for token identical to the wrapped tokenizer's: it splits text only
//     at points where that is provably true (split.go states the argument,
//     cached_test.go checks it differentially and by fuzzing). It keeps
//     copies of prefix text (never the caller's memory) within its byte
//     bound. Stats exposes hit/miss counters for the caller's metrics.
//   - RenderChat and ParseMessages are the one chat rendering shared by
//     the simulator and the gateway: deterministic ChatML-like text; text
//     parts only (other parts wrap ErrUnsupportedContent).
//
// The package starts no goroutines and logs nothing (prompt text never
// leaves it except as tokens).
package tokenizer
