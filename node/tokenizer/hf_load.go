package tokenizer

import (
	"encoding/json"
	"errors"
	"fmt"
	"os"
	"path/filepath"
	"strings"
)

// ErrUnsupported is returned by LoadHF for a tokenizer.json that uses a
// component (normalizer, pre-tokenizer, model option, added-token option,
// post-processor) this package does not reproduce exactly. Loading fails
// rather than producing tokens that might differ from the engine's.
var ErrUnsupported = errors.New("tokenizer: unsupported Hugging Face tokenizer component")

// hfFile is the part of a Hugging Face tokenizer.json that LoadHF reads.
type hfFile struct {
	AddedTokens   []hfAddedToken  `json:"added_tokens"`
	Normalizer    json.RawMessage `json:"normalizer"`
	PreTokenizer  json.RawMessage `json:"pre_tokenizer"`
	PostProcessor json.RawMessage `json:"post_processor"`
	Decoder       json.RawMessage `json:"decoder"`
	Model         struct {
		Type                    string            `json:"type"`
		Dropout                 *float64          `json:"dropout"`
		UnkToken                *string           `json:"unk_token"`
		ContinuingSubwordPrefix *string           `json:"continuing_subword_prefix"`
		EndOfWordSuffix         *string           `json:"end_of_word_suffix"`
		ByteFallback            bool              `json:"byte_fallback"`
		IgnoreMerges            bool              `json:"ignore_merges"`
		Vocab                   map[string]uint32 `json:"vocab"`
		Merges                  json.RawMessage   `json:"merges"`
	} `json:"model"`
}

type hfAddedToken struct {
	ID         uint32 `json:"id"`
	Content    string `json:"content"`
	SingleWord bool   `json:"single_word"`
	LStrip     bool   `json:"lstrip"`
	RStrip     bool   `json:"rstrip"`
	Normalized bool   `json:"normalized"`
	Special    bool   `json:"special"`
}

// hfComponent is a normalizer, pre-tokenizer, post-processor or decoder.
type hfComponent struct {
	Type           string          `json:"type"`
	Normalizers    []hfComponent   `json:"normalizers"`
	Pretokenizers  []hfComponent   `json:"pretokenizers"`
	Processors     []hfComponent   `json:"processors"`
	Pattern        json.RawMessage `json:"pattern"`
	Behavior       string          `json:"behavior"`
	Invert         bool            `json:"invert"`
	AddPrefixSpace bool            `json:"add_prefix_space"`
	UseRegex       *bool           `json:"use_regex"`
	Single         []hfTemplate    `json:"single"`
	SpecialTokens  map[string]struct {
		IDs []uint32 `json:"ids"`
	} `json:"special_tokens"`
}

// hfTemplate is one element of a TemplateProcessing template.
type hfTemplate struct {
	SpecialToken *struct {
		ID string `json:"id"`
	} `json:"SpecialToken"`
	Sequence *struct {
		ID string `json:"id"`
	} `json:"Sequence"`
}

// hfTokenizerConfig is the part of tokenizer_config.json that LoadHF reads.
type hfTokenizerConfig struct {
	ChatTemplate   json.RawMessage `json:"chat_template"`
	BOSToken       json.RawMessage `json:"bos_token"`
	EOSToken       json.RawMessage `json:"eos_token"`
	TokenizerClass string          `json:"tokenizer_class"`
	AddBOSToken    *bool           `json:"add_bos_token"`
	AddEOSToken    *bool           `json:"add_eos_token"`
}

// The pre-tokenizer split regexes LoadHF reproduces with a hand-written
// scanner (hf_pretok.go). Any other pattern is ErrUnsupported.
const (
	// patQwen2 is the Qwen2, Qwen2.5 and Qwen3 pattern (digits one by one).
	patQwen2 = `(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}| ?[^\s\p{L}\p{N}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+`
	// patLlama3 is the Llama 3.x pattern (= cl100k_base's, digits in threes).
	patLlama3 = `(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}{1,3}| ?[^\s\p{L}\p{N}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+`
)

// LoadHF loads a Hugging Face tokenizer from dir, which holds
// tokenizer.json and (optionally) tokenizer_config.json. It supports
// byte-level BPE tokenizers whose pre-tokenizer is one of the known split
// regex sets (Qwen2/2.5/3, Llama 3.x, DeepSeek V3) followed by ByteLevel,
// with an NFC or no normalizer, and a ByteLevel and/or TemplateProcessing
// post-processor (or, for a LlamaTokenizerFast config, transformers' BOS
// rule).
// Anything else returns an error wrapping ErrUnsupported; unreadable files
// wrap ErrLoad.
func LoadHF(dir string) (*HF, error) {
	data, err := os.ReadFile(filepath.Join(dir, "tokenizer.json"))
	if err != nil {
		return nil, fmt.Errorf("%w: %w", ErrLoad, err)
	}
	var f hfFile
	if err := json.Unmarshal(data, &f); err != nil {
		return nil, fmt.Errorf("%w: tokenizer.json: %w", ErrLoad, err)
	}
	var cfg hfTokenizerConfig
	if data, err := os.ReadFile(filepath.Join(dir, "tokenizer_config.json")); err == nil {
		if err := json.Unmarshal(data, &cfg); err != nil {
			return nil, fmt.Errorf("%w: tokenizer_config.json: %w", ErrLoad, err)
		}
	} else if !errors.Is(err, os.ErrNotExist) {
		return nil, fmt.Errorf("%w: %w", ErrLoad, err)
	}
	h, err := buildHF(&f)
	if err != nil {
		return nil, err
	}
	h.name = "hf:" + dir
	h.chatTemplate, h.bosToken, h.eosToken = parseChatConfig(&cfg)
	if err := h.llamaPost(&cfg); err != nil {
		return nil, err
	}
	return h, nil
}

// llamaPost applies transformers' LlamaTokenizerFast rule: that class
// replaces tokenizer.json's post-processor with BOS (add_bos_token,
// default true) + the text + EOS (add_eos_token, default false) when it
// loads (DeepSeek V3 declares it), so vLLM adds them to a completion.
func (h *HF) llamaPost(cfg *hfTokenizerConfig) error {
	if cfg.TokenizerClass != "LlamaTokenizerFast" {
		return nil
	}
	id := func(content string) (uint32, error) {
		for _, t := range h.added {
			if t.content == content {
				return t.id, nil
			}
		}
		if id, ok := h.vocab[content]; ok {
			return id, nil
		}
		return 0, fmt.Errorf("%w: special token %q is not in the vocabulary", ErrLoad, content)
	}
	h.postPrefix, h.postSuffix = nil, nil
	if (cfg.AddBOSToken == nil || *cfg.AddBOSToken) && h.bosToken != "" {
		bos, err := id(h.bosToken)
		if err != nil {
			return err
		}
		h.postPrefix = []uint32{bos}
	}
	if cfg.AddEOSToken != nil && *cfg.AddEOSToken && h.eosToken != "" {
		eos, err := id(h.eosToken)
		if err != nil {
			return err
		}
		h.postSuffix = []uint32{eos}
	}
	return nil
}

func buildHF(f *hfFile) (*HF, error) {
	m := &f.Model
	switch {
	case m.Type != "BPE":
		return nil, fmt.Errorf("%w: model type %q (want BPE)", ErrUnsupported, m.Type)
	case m.Dropout != nil && *m.Dropout != 0:
		return nil, fmt.Errorf("%w: BPE dropout", ErrUnsupported)
	case m.ByteFallback:
		return nil, fmt.Errorf("%w: BPE byte_fallback", ErrUnsupported)
	case m.ContinuingSubwordPrefix != nil && *m.ContinuingSubwordPrefix != "":
		return nil, fmt.Errorf("%w: BPE continuing_subword_prefix", ErrUnsupported)
	case m.EndOfWordSuffix != nil && *m.EndOfWordSuffix != "":
		return nil, fmt.Errorf("%w: BPE end_of_word_suffix", ErrUnsupported)
	}
	h := &HF{ignoreMerges: m.IgnoreMerges}

	// Normalizer: none or NFC.
	norm, err := parseComponent(f.Normalizer)
	if err != nil {
		return nil, err
	}
	switch {
	case norm == nil:
	case norm.Type == "NFC":
		h.nfc = true
	case norm.Type == "Sequence" && len(norm.Normalizers) == 0:
	case norm.Type == "Sequence" && len(norm.Normalizers) == 1 && norm.Normalizers[0].Type == "NFC":
		h.nfc = true
	default:
		return nil, fmt.Errorf("%w: normalizer %q", ErrUnsupported, norm.Type)
	}

	// Pre-tokenizer: Sequence[Split(known regex, Isolated), ByteLevel(no
	// prefix space, no regex)], or DeepSeek V3's three Splits + ByteLevel.
	pre, err := parseComponent(f.PreTokenizer)
	if err != nil {
		return nil, err
	}
	if pre == nil || pre.Type != "Sequence" || len(pre.Pretokenizers) < 2 {
		return nil, fmt.Errorf("%w: pre-tokenizer (want Sequence[Split..., ByteLevel])", ErrUnsupported)
	}
	var regexes []string
	for _, split := range pre.Pretokenizers[:len(pre.Pretokenizers)-1] {
		if split.Type != "Split" || split.Behavior != "Isolated" || split.Invert {
			return nil, fmt.Errorf("%w: pre-tokenizer %q behavior %q invert %v", ErrUnsupported, split.Type, split.Behavior, split.Invert)
		}
		var pat struct{ Regex *string }
		if err := json.Unmarshal(split.Pattern, &pat); err != nil || pat.Regex == nil {
			return nil, fmt.Errorf("%w: Split pattern is not a regex", ErrUnsupported)
		}
		regexes = append(regexes, *pat.Regex)
	}
	switch {
	case len(regexes) == 1 && regexes[0] == patQwen2:
		h.maxDigits = 1
	case len(regexes) == 1 && regexes[0] == patLlama3:
		h.maxDigits = 3
	case len(regexes) == 3 && regexes[0] == patDeepSeekDigits && regexes[1] == patDeepSeekCJK && regexes[2] == patDeepSeekWords:
		h.deepseek = true
	default:
		return nil, fmt.Errorf("%w: Split regexes %q", ErrUnsupported, regexes)
	}
	bl := pre.Pretokenizers[len(pre.Pretokenizers)-1]
	if bl.Type != "ByteLevel" || bl.AddPrefixSpace || (bl.UseRegex != nil && *bl.UseRegex) {
		return nil, fmt.Errorf("%w: pre-tokenizer %q (want ByteLevel without prefix space or regex)", ErrUnsupported, bl.Type)
	}

	added := make(map[string]uint32, len(f.AddedTokens))
	for _, t := range f.AddedTokens {
		added[t.Content] = t.ID
	}
	if err := h.buildVocab(m.Vocab, m.Merges, added); err != nil {
		return nil, err
	}
	if err := h.buildAdded(f.AddedTokens); err != nil {
		return nil, err
	}
	post, err := parseComponent(f.PostProcessor)
	if err != nil {
		return nil, err
	}
	if err := h.buildPost(post); err != nil {
		return nil, err
	}
	h.buildSelfEncoding()
	return h, nil
}

func parseComponent(raw json.RawMessage) (*hfComponent, error) {
	if len(raw) == 0 || string(raw) == "null" {
		return nil, nil
	}
	var c hfComponent
	if err := json.Unmarshal(raw, &c); err != nil {
		return nil, fmt.Errorf("%w: %w", ErrLoad, err)
	}
	return &c, nil
}

// byteLevelAlphabet returns GPT-2's byte-to-rune table: printable bytes
// map to themselves, the others to U+0100 upwards in byte order.
func byteLevelAlphabet() (enc [256]rune) {
	n := rune(0)
	for b := range 256 {
		if (b >= '!' && b <= '~') || (b >= 0xA1 && b <= 0xAC) || (b >= 0xAE && b <= 0xFF) {
			enc[b] = rune(b)
		} else {
			enc[b] = 256 + n
			n++
		}
	}
	return enc
}

// byteLevelDecode turns a vocabulary string (byte-level runes) into its
// bytes; ok is false if a rune is outside the alphabet.
func byteLevelDecode(s string, dec map[rune]byte) ([]byte, bool) {
	out := make([]byte, 0, len(s))
	for _, r := range s {
		b, ok := dec[r]
		if !ok {
			return nil, false
		}
		out = append(out, b)
	}
	return out, true
}

// buildVocab converts the vocabulary and merges to raw bytes and checks
// whether the merges are rank-monotone (see HF.monotone).
//
// A vocabulary entry that is also an added token with the same id (some
// files list special tokens in both) is left to the added tokens.
func (h *HF) buildVocab(vocab map[string]uint32, mergesRaw json.RawMessage, added map[string]uint32) error {
	alpha := byteLevelAlphabet()
	dec := make(map[rune]byte, 256)
	for b, r := range alpha {
		dec[r] = byte(b)
	}
	maxID := uint32(0)
	for _, id := range vocab {
		maxID = max(maxID, id)
	}
	h.tokBytes = make([]string, maxID+1)
	h.vocab = make(map[string]uint32, len(vocab))
	for s, id := range vocab {
		b, ok := byteLevelDecode(s, dec)
		if !ok {
			if aid, isAdded := added[s]; isAdded && aid == id {
				continue
			}
			return fmt.Errorf("%w: vocabulary token %d is not byte-level", ErrUnsupported, id)
		}
		h.tokBytes[id] = string(b)
		h.vocab[string(b)] = id
	}
	for b := range 256 {
		id, ok := h.vocab[string([]byte{byte(b)})]
		if !ok {
			return fmt.Errorf("%w: byte 0x%02x has no token", ErrUnsupported, b)
		}
		h.byteID[b] = id
	}

	// Merges: ["a b", ...] or [["a","b"], ...].
	var asStrings []string
	var asPairs [][2]string
	if err := json.Unmarshal(mergesRaw, &asStrings); err != nil {
		if err2 := json.Unmarshal(mergesRaw, &asPairs); err2 != nil {
			return fmt.Errorf("%w: merges: %w", ErrLoad, err2)
		}
	} else {
		asPairs = make([][2]string, len(asStrings))
		for i, s := range asStrings {
			a, b, ok := strings.Cut(s, " ")
			if !ok {
				return fmt.Errorf("%w: merge %d has no space", ErrLoad, i)
			}
			asPairs[i] = [2]string{a, b}
		}
	}
	h.merges = make(map[uint64]uint64, len(asPairs))
	// maxMade[t] is the highest rank of a merge producing t, minUsed[t]
	// the lowest rank of a merge consuming it.
	maxMade := make([]int, len(h.tokBytes))
	minUsed := make([]int, len(h.tokBytes))
	for i := range maxMade {
		maxMade[i], minUsed[i] = -1, len(asPairs)
	}
	for rank, p := range asPairs {
		a, okA := vocab[p[0]]
		b, okB := vocab[p[1]]
		c, okC := vocab[p[0]+p[1]]
		if !okA || !okB || !okC {
			return fmt.Errorf("%w: merge %d (%q %q) names a token outside the vocabulary", ErrUnsupported, rank, p[0], p[1])
		}
		k := uint64(a)<<32 | uint64(b)
		if _, dup := h.merges[k]; dup {
			continue // the first (lowest-rank) occurrence wins, as in HF
		}
		maxMade[c] = rank
		minUsed[a] = min(minUsed[a], rank)
		minUsed[b] = min(minUsed[b], rank)
		h.merges[k] = uint64(rank)<<32 | uint64(c)
	}
	// minUsed lets bpeRuns check, rule by rule, that a merge creates no
	// pair of lower rank than its own; monotone says that holds for all.
	h.minUsed = make([]uint32, len(minUsed))
	h.monotone = true
	for t := range maxMade {
		h.minUsed[t] = uint32(minUsed[t])
		if maxMade[t] >= minUsed[t] {
			h.monotone = false
		}
	}
	return nil
}

// buildAdded indexes the added tokens. Options whose splitting rules
// this package does not implement are ErrUnsupported.
func (h *HF) buildAdded(added []hfAddedToken) error {
	for _, t := range added {
		if t.SingleWord || t.LStrip || t.RStrip {
			return fmt.Errorf("%w: added token %d with single_word/lstrip/rstrip", ErrUnsupported, t.ID)
		}
		if t.Content == "" {
			continue
		}
		if int(t.ID) >= len(h.tokBytes) {
			grown := make([]string, t.ID+1)
			copy(grown, h.tokBytes)
			h.tokBytes = grown
		}
		h.tokBytes[t.ID] = t.Content
		// With a normalizer, a normalized token is looked for in the
		// normalized text, after the others (as HF's AddedVocabulary does).
		late := t.Normalized && h.nfc
		h.added = append(h.added, addedToken{content: t.Content, id: t.ID, special: t.Special, normalized: late})
	}
	h.buildAddedMatcher()
	return nil
}

// buildPost reads the post-processor: ByteLevel (adds nothing) and/or
// TemplateProcessing (special tokens around the single sequence).
func (h *HF) buildPost(c *hfComponent) error {
	if c == nil {
		return nil
	}
	switch c.Type {
	case "ByteLevel":
		return nil
	case "Sequence":
		for i := range c.Processors {
			if err := h.buildPost(&c.Processors[i]); err != nil {
				return err
			}
		}
		return nil
	case "TemplateProcessing":
		seen := false
		for _, el := range c.Single {
			switch {
			case el.Sequence != nil:
				if el.Sequence.ID != "A" || seen {
					return fmt.Errorf("%w: TemplateProcessing single template", ErrUnsupported)
				}
				seen = true
			case el.SpecialToken != nil:
				st, ok := c.SpecialTokens[el.SpecialToken.ID]
				if !ok {
					return fmt.Errorf("%w: TemplateProcessing names unknown special token %q", ErrLoad, el.SpecialToken.ID)
				}
				if seen {
					h.postSuffix = append(h.postSuffix, st.IDs...)
				} else {
					h.postPrefix = append(h.postPrefix, st.IDs...)
				}
			}
		}
		if !seen {
			return fmt.Errorf("%w: TemplateProcessing single template without $A", ErrUnsupported)
		}
		return nil
	}
	return fmt.Errorf("%w: post-processor %q", ErrUnsupported, c.Type)
}

// parseChatConfig reads the chat template and BOS/EOS strings. The
// template is a string or a list of named templates ("default" is used).
func parseChatConfig(c *hfTokenizerConfig) (tmpl, bos, eos string) {
	var s string
	if json.Unmarshal(c.ChatTemplate, &s) == nil {
		tmpl = s
	} else {
		var named []struct{ Name, Template string }
		if json.Unmarshal(c.ChatTemplate, &named) == nil {
			for _, n := range named {
				if n.Name == "default" {
					tmpl = n.Template
				}
			}
		}
	}
	return tmpl, tokenString(c.BOSToken), tokenString(c.EOSToken)
}

// tokenString reads a special token given as a string or as an object
// with a "content" field.
func tokenString(raw json.RawMessage) string {
	var s string
	if json.Unmarshal(raw, &s) == nil {
		return s
	}
	var o struct{ Content string }
	if json.Unmarshal(raw, &o) == nil {
		return o.Content
	}
	return ""
}
