package index

import (
	"encoding/binary"
	"errors"
	"testing"

	"github.com/zeebo/xxh3"
)

// naiveKeys is the key definition written out with fresh buffers.
func naiveKeys(root BlockKey, tokens []uint32, bs int) []BlockKey {
	var out []BlockKey
	k := uint64(root)
	for i := 0; i+bs <= len(tokens); i += bs {
		buf := binary.LittleEndian.AppendUint64(nil, k)
		for _, t := range tokens[i : i+bs] {
			buf = binary.LittleEndian.AppendUint32(buf, t)
		}
		k = xxh3.Hash(buf)
		out = append(out, BlockKey(k))
	}
	return out
}

func seqTokens(n int, base uint32) []uint32 {
	t := make([]uint32, n)
	for i := range t {
		t[i] = base + uint32(i)*2654435761
	}
	return t
}

func TestHasherDefinition(t *testing.T) {
	for _, tc := range []struct {
		name    string
		bs, n   int
		want    int
		seed    uint64
		partial bool
	}{
		{"empty", 16, 0, 0, 1, false},
		{"short", 16, 15, 0, 1, true},
		{"one", 16, 16, 1, 1, false},
		{"partial tail", 16, 40, 2, 7, true},
		{"5K", 16, 5000, 312, 7, true},
		{"block 1", 1, 5, 5, 0, false},
		{"block max", MaxBlockTokens, 2*MaxBlockTokens + 3, 2, 9, true},
	} {
		t.Run(tc.name, func(t *testing.T) {
			h, err := NewHasher(tc.seed, tc.bs)
			if err != nil {
				t.Fatal(err)
			}
			root := h.Root("m", "", "")
			toks := seqTokens(tc.n, 3)
			got := h.AppendKeys(nil, root, toks)
			if len(got) != tc.want {
				t.Fatalf("len %d, want %d", len(got), tc.want)
			}
			want := naiveKeys(root, toks, tc.bs)
			for i := range want {
				if got[i] != want[i] {
					t.Fatalf("key %d: %x want %x", i, got[i], want[i])
				}
			}
		})
	}
}

func TestHasherChainAndAppend(t *testing.T) {
	h, _ := NewHasher(42, 16)
	root := h.Root("llama", "", "")
	toks := seqTokens(160, 1)
	all := h.AppendKeys(nil, root, toks)
	// Keys of a prefix are a prefix of the keys; continuing from a key gives the rest.
	first := h.AppendKeys(nil, root, toks[:64])
	rest := h.AppendKeys(first, first[3], toks[64:])
	for i := range all {
		if rest[i] != all[i] {
			t.Fatalf("key %d differs when continued from a parent", i)
		}
	}
	// Changing one token changes that block's key and every later one, not earlier ones.
	toks2 := append([]uint32(nil), toks...)
	toks2[5*16+3]++
	other := h.AppendKeys(nil, root, toks2)
	for i := range all {
		if (i < 5) != (all[i] == other[i]) {
			t.Fatalf("block %d: equal=%v", i, all[i] == other[i])
		}
	}
}

func TestRootDistinguishes(t *testing.T) {
	h1, _ := NewHasher(1, 16)
	h2, _ := NewHasher(2, 16)
	roots := map[BlockKey]string{}
	for name, r := range map[string]BlockKey{
		"m":        h1.Root("m", "", ""),
		"m/lora":   h1.Root("m", "a", ""),
		"m/salt":   h1.Root("m", "", "a"),
		"lora<>m":  h1.Root("", "m", ""),
		"seed2":    h2.Root("m", "", ""),
		"m2":       h1.Root("m2", "", ""),
		"empty":    h1.Root("", "", ""),
		"ab/c":     h1.Root("ab", "c", ""),
		"a/bc":     h1.Root("a", "bc", ""),
		"salt<>lo": h1.Root("m", "s", "l"),
	} {
		if prev, dup := roots[r]; dup {
			t.Fatalf("roots of %s and %s collide", name, prev)
		}
		roots[r] = name
	}
	h1b, _ := NewHasher(1, 16)
	if h1.Root("m", "x", "y") != h1b.Root("m", "x", "y") {
		t.Fatal("Root is not deterministic: two hashers with one seed disagree")
	}
}

func TestCharacterModeEqualsWidenedTokens(t *testing.T) {
	h, _ := NewHasher(5, 128)
	text := []byte{}
	for i := range 1000 {
		text = append(text, byte('a'+i%26), byte(i))
	}
	wide := make([]uint32, len(text))
	for i, b := range text {
		wide[i] = uint32(b)
	}
	root := h.Root("m", "", "")
	want := h.AppendKeys(nil, root, wide)
	gotB := h.AppendKeysBytes(nil, root, text)
	gotS := h.AppendKeysString(nil, root, string(text))
	if len(want) != len(text)/128 || len(gotB) != len(want) || len(gotS) != len(want) {
		t.Fatalf("lengths %d %d %d", len(want), len(gotB), len(gotS))
	}
	for i := range want {
		if gotB[i] != want[i] || gotS[i] != want[i] {
			t.Fatalf("block %d differs", i)
		}
	}
}

func TestHasherNoAllocs(t *testing.T) {
	h, _ := NewHasher(1, 16)
	toks := seqTokens(5000, 1)
	text := string(make([]byte, 5000))
	dst := make([]BlockKey, 0, 400)
	root := h.Root("m", "l", "s")
	if a := testing.AllocsPerRun(50, func() {
		dst = h.AppendKeys(dst[:0], root, toks)
		dst = h.AppendKeysString(dst[:0], root, text)
		root = h.Root("m", "l", "s")
	}); a != 0 {
		t.Fatalf("%v allocs per run, want 0", a)
	}
}

func TestNewHasherRejects(t *testing.T) {
	for _, bs := range []int{0, -1, MaxBlockTokens + 1} {
		if _, err := NewHasher(0, bs); !errors.Is(err, ErrInvalidConfig) {
			t.Fatalf("block size %d: err %v", bs, err)
		}
	}
}

func TestParseMode(t *testing.T) {
	for _, m := range []Mode{ModeHistory, ModeKVEvents, ModeHybrid} {
		got, err := ParseMode(m.String())
		if err != nil || got != m {
			t.Fatalf("%v: %v %v", m, got, err)
		}
	}
	if _, err := ParseMode("nope"); !errors.Is(err, ErrUnknownMode) {
		t.Fatal(err)
	}
}
