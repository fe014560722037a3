package buildinfo

import (
	"runtime"
	"strings"
	"testing"
)

func TestStringNamesCommandVersionAndToolchain(t *testing.T) {
	s := String("vllmsim")
	if !strings.HasPrefix(s, "vllmsim "+Get().Version+" (revision ") {
		t.Fatalf("String = %q", s)
	}
	if !strings.HasSuffix(s, runtime.Version()+")") {
		t.Fatalf("String = %q, want the Go version %s", s, runtime.Version())
	}
	if Get().Version == "" || Get().Revision == "" {
		t.Fatalf("Get = %+v: empty fields", Get())
	}
}
