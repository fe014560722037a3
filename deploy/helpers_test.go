package deploy_test

import (
	"bufio"
	"bytes"
	"context"
	"errors"
	"fmt"
	"io"
	"net/http"
	"os"
	"os/exec"
	"path/filepath"
	"regexp"
	"slices"
	"strings"
	"sync"
	"syscall"
	"testing"
	"time"

	"go.uber.org/goleak"
	"gopkg.in/yaml.v3"
)

// repoRoot is the module root, seen from the deploy/ test directory.
const repoRoot = ".."

// ourBinaries are the programs the kvmesh image ships, by base name.
var ourBinaries = []string{"kvmesh", "vllmsim", "kvbench"}

// natsServerPkg is nats-server's main package; go build names it
// "nats-server".
const natsServerPkg = "github.com/nats-io/nats-server/v2"

// binDir holds the binaries built once for the whole test run.
var binDir struct {
	once sync.Once
	dir  string
	err  error
}

func TestMain(m *testing.M) {
	code := m.Run()
	if binDir.dir != "" {
		_ = os.RemoveAll(binDir.dir)
	}
	// Every goroutine the tests started (log scanners, process waiters,
	// request senders) has ended; only idle keep-alive connections remain.
	http.DefaultClient.CloseIdleConnections()
	if code == 0 {
		if err := goleak.Find(); err != nil {
			fmt.Fprintln(os.Stderr, "goleak:", err)
			code = 1
		}
	}
	os.Exit(code)
}

// goTool is the go command of the toolchain running the tests.
func goTool() string {
	if p, err := exec.LookPath("go"); err == nil {
		return p
	}
	// Not on PATH: $GOROOT (go test sets it for the test binary), else
	// the usual install location.
	if root := os.Getenv("GOROOT"); root != "" {
		return filepath.Join(root, "bin", "go")
	}
	return "/usr/local/go/bin/go"
}

// binaries builds kvmesh, vllmsim and kvbench once per test run and
// returns their directory. They are built with the toolchain's default
// cgo setting, as the other packages' tests compile their dependencies,
// so the build links what go test has compiled already. The Dockerfile's
// CGO_ENABLED=0 would compile the whole dependency graph a second time (net
// differs without cgo, and everything above it): 82 s against 8 s on a
// quiet 2-core machine after a cold build, and past go test's 10-minute
// limit in all five of a batch of .ci/run on fresh clones at once
// (ci960–964). TestDockerfile checks the static build with go list.
func binaries(t testing.TB) string {
	t.Helper()
	binDir.once.Do(func() {
		dir, err := os.MkdirTemp("", "kvmesh-deploy-bin-")
		if err != nil {
			binDir.err = err
			return
		}
		binDir.dir = dir
		// -s -w as the Dockerfile (and a faster link); no -trimpath, so the
		// compiled packages are shared with the test builds' cache.
		args := []string{"build", "-ldflags=-s -w", "-o", dir + string(filepath.Separator)}
		for _, b := range ourBinaries {
			args = append(args, "./cmd/"+b)
		}
		// The external NATS of the cluster tests, built from the module the
		// gateway embeds (no download): compose and prod use an external one.
		args = append(args, natsServerPkg)
		cmd := exec.Command(goTool(), args...)
		cmd.Dir = repoRoot
		if out, err := cmd.CombinedOutput(); err != nil {
			binDir.err = fmt.Errorf("go build: %w\n%s", err, out)
		}
	})
	if binDir.err != nil {
		t.Fatal(binDir.err)
	}
	return binDir.dir
}

// readYAMLDocs parses every document of a YAML file or stream.
func readYAMLDocs(t testing.TB, name string, data []byte) []map[string]any {
	t.Helper()
	var docs []map[string]any
	dec := yaml.NewDecoder(bytes.NewReader(data))
	for {
		var doc map[string]any
		err := dec.Decode(&doc)
		if errors.Is(err, io.EOF) {
			break
		}
		if err != nil {
			t.Fatalf("%s: yaml: %v", name, err)
		}
		if doc != nil {
			docs = append(docs, doc)
		}
	}
	return docs
}

func readYAMLFile(t testing.TB, path string) []map[string]any {
	t.Helper()
	data, err := os.ReadFile(path)
	if err != nil {
		t.Fatal(err)
	}
	return readYAMLDocs(t, path, data)
}

// flagSpec is one command's flags: name → whether it takes a value.
type flagSpec map[string]bool

var (
	// cobra: "  -h, --help   help for serve" / "      --config string   YAML ...".
	cobraFlagLine = regexp.MustCompile(`^\s+(?:-([a-zA-Z0-9]), )?--([a-zA-Z0-9][a-zA-Z0-9._-]*)(?: ([a-zA-Z0-9]+))?(?:\s{2,}|$)`)
)

// parseCobraHelp reads the flags of a cobra command's --help output.
func parseCobraHelp(out string) flagSpec {
	fs := flagSpec{}
	for line := range strings.Lines(out) {
		m := cobraFlagLine.FindStringSubmatch(strings.TrimRight(line, "\n"))
		if m == nil {
			continue
		}
		fs[m[2]] = m[3] != "" && m[3] != "bool"
		if m[1] != "" {
			fs[m[1]] = fs[m[2]]
		}
	}
	return fs
}

// commandFlags are the flags of every command the manifests may run, keyed
// "kvmesh serve", "vllmsim", "kvbench", read from the built binaries' help.
var commandFlags struct {
	once sync.Once
	m    map[string]flagSpec
	err  error
}

func flagsOf(t testing.TB) map[string]flagSpec {
	t.Helper()
	dir := binaries(t)
	commandFlags.once.Do(func() {
		m := map[string]flagSpec{}
		help := func(bin string, args ...string) (string, error) {
			ctx, cancel := context.WithTimeout(context.Background(), 30*time.Second)
			defer cancel()
			out, err := exec.CommandContext(ctx, filepath.Join(dir, bin), args...).CombinedOutput()
			if err != nil {
				return "", fmt.Errorf("%s %v: %w\n%s", bin, args, err, out)
			}
			return string(out), nil
		}
		root, err := help("kvmesh", "--help")
		if err != nil {
			commandFlags.err = err
			return
		}
		// Every kvmesh subcommand listed under "Available Commands", and
		// theirs (kvmesh config get, ...).
		var walk func(path []string, out string) error
		walk = func(path []string, out string) error {
			for _, sub := range subcommands(out) {
				p := append(slices.Clone(path), sub)
				out, err := help("kvmesh", append(p, "--help")...)
				if err != nil {
					return err
				}
				m["kvmesh "+strings.Join(p, " ")] = parseCobraHelp(out)
				if err := walk(p, out); err != nil {
					return err
				}
			}
			return nil
		}
		if err := walk(nil, root); err != nil {
			commandFlags.err = err
			return
		}
		out, err := help("vllmsim", "--help")
		if err != nil {
			commandFlags.err = err
			return
		}
		m["vllmsim"] = parseCobraHelp(out) // pflag's usage, as cobra's
		if out, err = help("kvbench", "--help"); err != nil {
			commandFlags.err = err
			return
		}
		m["kvbench"] = parseCobraHelp(out)
		commandFlags.m = m
	})
	if commandFlags.err != nil {
		t.Fatal(commandFlags.err)
	}
	return commandFlags.m
}

// subcommands lists the "Available Commands" of a cobra help text, without
// cobra's own help and completion.
func subcommands(help string) []string {
	var out []string
	in := false
	for line := range strings.Lines(help) {
		line = strings.TrimRight(line, "\n")
		switch {
		case strings.HasPrefix(line, "Available Commands:"):
			in = true
		case in && strings.TrimSpace(line) == "":
			in = false
		case in:
			if sub := strings.Fields(line)[0]; sub != "help" && sub != "completion" {
				out = append(out, sub)
			}
		}
	}
	return out
}

// checkArgv reports why argv (a container's command + args) would not
// parse: unknown binary or subcommand, unknown flag, a value flag without
// value, a stray positional argument. Values may hold $(VAR) references.
func checkArgv(flags map[string]flagSpec, argv []string) error {
	if len(argv) == 0 {
		return errors.New("empty command")
	}
	bin := filepath.Base(argv[0])
	if argv[0] != "/usr/local/bin/"+bin {
		return fmt.Errorf("%q: want an absolute path in /usr/local/bin/ (the image has no shell and sets no entrypoint)", argv[0])
	}
	rest := argv[1:]
	key := bin
	switch bin {
	case "kvmesh":
		if len(rest) == 0 || strings.HasPrefix(rest[0], "-") {
			return errors.New("kvmesh needs a subcommand")
		}
		key, rest = "kvmesh "+rest[0], rest[1:]
		// Nested subcommands: kvmesh config get ...
		for len(rest) > 0 && flags[key+" "+rest[0]] != nil {
			key, rest = key+" "+rest[0], rest[1:]
		}
	case "vllmsim":
		if len(rest) > 0 && !strings.HasPrefix(rest[0], "-") {
			rest = rest[1:] // vLLM's positional MODEL
		}
	case "kvbench":
	default:
		return fmt.Errorf("%q is not one of %v", bin, ourBinaries)
	}
	spec, ok := flags[key]
	if !ok {
		return fmt.Errorf("%q: no such command", key)
	}
	for i := 0; i < len(rest); i++ {
		tok := rest[i]
		if tok == "--" {
			return fmt.Errorf("%s: unexpected -- (no command takes positional arguments)", key)
		}
		if !strings.HasPrefix(tok, "-") || tok == "-" {
			return fmt.Errorf("%s: unexpected argument %q", key, tok)
		}
		name, _, hasValue := strings.Cut(strings.TrimLeft(tok, "-"), "=")
		if !strings.HasPrefix(tok, "--") && len(name) > 1 {
			return fmt.Errorf("%s: %q: long flags take two dashes (GNU style)", key, tok)
		}
		takesValue, known := spec[name]
		if !known {
			return fmt.Errorf("%s: unknown flag %q", key, tok)
		}
		if takesValue && !hasValue {
			if i+1 >= len(rest) {
				return fmt.Errorf("%s: flag %q needs a value", key, tok)
			}
			i++
		}
	}
	return nil
}

// proc is a binary started by a test, with its log kept for failures.
type proc struct {
	name string
	cmd  *exec.Cmd
	mu   sync.Mutex
	log  bytes.Buffer
	done chan struct{} // closed when the process has exited
	err  error         // Wait's result, valid after done
}

// startProc starts bin with args and waits until a log line matches ready,
// returning the submatches. The process is stopped (SIGTERM, then
// SIGKILL after 10 s) at cleanup.
func startProc(t *testing.T, name, bin string, args []string, ready *regexp.Regexp) (*proc, []string) {
	t.Helper()
	p := &proc{name: name, cmd: exec.Command(bin, args...), done: make(chan struct{})}
	setParentDeathSignal(p.cmd) // no orphan if the test binary dies
	pr, pw := io.Pipe()
	p.cmd.Stdout = pw
	p.cmd.Stderr = pw
	if err := p.cmd.Start(); err != nil {
		t.Fatalf("start %s: %v", name, err)
	}
	found := make(chan []string, 1)
	scanned := make(chan struct{})
	go func() { // owner: ends when the pipe is closed after Wait
		defer close(scanned)
		sc := bufio.NewScanner(pr)
		sc.Buffer(make([]byte, 64<<10), 1<<20)
		for sc.Scan() {
			line := sc.Text()
			p.mu.Lock()
			p.log.WriteString(line + "\n")
			p.mu.Unlock()
			if m := ready.FindStringSubmatch(line); m != nil {
				select {
				case found <- m[1:]:
				default:
				}
			}
		}
		_, _ = io.Copy(io.Discard, pr)
	}()
	go func() { // owner: ends when the process exits
		p.err = p.cmd.Wait()
		_ = pw.Close()
		<-scanned
		close(p.done)
	}()
	t.Cleanup(func() {
		p.stop(10 * time.Second)
		if t.Failed() {
			t.Logf("--- log of %s ---\n%s", name, p.logs())
		}
	})
	select {
	case v := <-found:
		return p, v
	case <-p.done:
		t.Fatalf("%s exited before it was ready: %v\n%s", name, p.err, p.logs())
	case <-time.After(30 * time.Second):
		t.Fatalf("%s not ready within 30s\n%s", name, p.logs())
	}
	return nil, nil
}

func (p *proc) logs() string {
	p.mu.Lock()
	defer p.mu.Unlock()
	return p.log.String()
}

// stop sends SIGTERM and waits up to grace, then kills.
func (p *proc) stop(grace time.Duration) {
	select {
	case <-p.done:
		return
	default:
	}
	_ = p.cmd.Process.Signal(syscall.SIGTERM)
	select {
	case <-p.done:
	case <-time.After(grace):
		_ = p.cmd.Process.Kill()
		<-p.done
	}
}
