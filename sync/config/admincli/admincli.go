package admincli

import (
	"bytes"
	"context"
	"encoding/json"
	"errors"
	"fmt"
	"io"
	"os"
	"os/exec"
	"strings"
	"text/tabwriter"
	"time"

	"github.com/spf13/cobra"
	"google.golang.org/grpc/codes"
	"google.golang.org/grpc/status"
	"gopkg.in/yaml.v3"

	"github.com/kvmesh/kvmesh/proto/adminpb"
	"github.com/kvmesh/kvmesh/sync/config"
)

// AddrEnv is the environment variable holding the default admin address.
const AddrEnv = "KVMESH_ADMIN_ADDR"

// DefaultAddr is the admin address used when neither --admin-addr nor
// KVMESH_ADMIN_ADDR is set: a gateway on this machine started with the
// default admin listen address (config.DefaultAdminPort).
const DefaultAddr = "127.0.0.1:" + config.DefaultAdminPort

// conn holds the connection flags every command shares.
type conn struct {
	addr      string
	addrFrom  string // where addr came from when --admin-addr is not given
	token     string
	tokenFile string
	tls       config.TLSFiles
	timeout   time.Duration
}

func (c *conn) bind(cmd *cobra.Command) {
	fl := cmd.Flags()
	def := os.Getenv(AddrEnv)
	c.addrFrom = "$" + AddrEnv
	if def == "" {
		def, c.addrFrom = DefaultAddr, "the default: no --admin-addr given"
	}
	fl.StringVar(&c.addr, "admin-addr", def, "gateway admin gRPC address (env "+AddrEnv+")")
	fl.StringVar(&c.token, "token", "", "admin bearer token (default env "+config.TokenEnv+", else --token-file)")
	fl.StringVar(&c.tokenFile, "token-file", "", "file whose first line is the admin token")
	fl.StringVar(&c.tls.CAFile, "tls-ca", "", "CA certificate to verify the gateway (turns TLS on)")
	fl.StringVar(&c.tls.CertFile, "tls-cert", "", "client certificate (mutual TLS)")
	fl.StringVar(&c.tls.KeyFile, "tls-key", "", "client key (mutual TLS)")
	fl.DurationVar(&c.timeout, "timeout", 15*time.Second, "bound on each call")
}

func (c *conn) dial() (*config.Client, error) {
	tok, err := config.LoadToken(c.token, c.tokenFile)
	if err != nil {
		return nil, err
	}
	tc, err := c.tls.ClientConfig()
	if err != nil {
		return nil, err
	}
	return config.Dial(c.addr, config.ClientOptions{Token: tok, TLS: tc})
}

func (c *conn) ctx(parent context.Context) (context.Context, context.CancelFunc) {
	if parent == nil {
		parent = context.Background()
	}
	return context.WithTimeout(parent, c.timeout)
}

// call dials the admin API, runs f with a context bounded by --timeout, and
// closes the connection: the shape every admin command shares.
func (c *conn) call(cmd *cobra.Command, f func(context.Context, *config.Client) error) error {
	cl, err := c.dial()
	if err != nil {
		return err
	}
	defer cl.Close()
	ctx, cancel := c.ctx(cmd.Context())
	defer cancel()
	return c.explain(cmd, f(ctx, cl))
}

// ErrUnreachable is returned when no admin API answers at the address.
var ErrUnreachable = errors.New("admincli: no admin API reachable")

// explain turns a transport failure into an error that names the address
// tried, where it came from and how to give another; gRPC's own text (a
// dial error inside a status) says none of that.
func (c *conn) explain(cmd *cobra.Command, err error) error {
	if status.Code(err) != codes.Unavailable && !errors.Is(err, context.DeadlineExceeded) {
		return err
	}
	from := "--admin-addr"
	if !cmd.Flags().Changed("admin-addr") {
		from = c.addrFrom
	}
	why := err.Error()
	if st, ok := status.FromError(err); ok {
		why = st.Message()
	}
	return fmt.Errorf("%w at %s (%s): %s\n"+
		"give a cluster gateway's admin address with --admin-addr HOST:PORT or $%s "+
		"(kvmesh serve --admin-addr; a standalone gateway has no admin API)", ErrUnreachable, c.addr, from, why, AddrEnv)
}

// Commands returns the "config" and "members" commands.
func Commands() []*cobra.Command {
	return []*cobra.Command{NewConfigCmd(), NewMembersCmd()}
}

// NewConfigCmd returns "config" with get, set, patch and edit.
func NewConfigCmd() *cobra.Command {
	cmd := &cobra.Command{Use: "config", Short: "Read and change the cluster's routing config"}
	cmd.AddCommand(newGetCmd(), newSetCmd(), newPatchCmd(), newEditCmd())
	return cmd
}

func newGetCmd() *cobra.Command {
	var c conn
	cmd := &cobra.Command{
		Use:   "get",
		Short: "Print the applied config as {\"version\": N, \"config\": {...}}",
		Args:  cobra.NoArgs,
		RunE: func(cmd *cobra.Command, _ []string) error {
			return c.call(cmd, func(ctx context.Context, cl *config.Client) error {
				v, err := cl.GetConfig(ctx)
				if err != nil {
					return err
				}
				return printJSON(cmd.OutOrStdout(), v)
			})
		},
	}
	c.bind(cmd)
	return cmd
}

func newSetCmd() *cobra.Command {
	var c conn
	var file string
	var expected int64
	var force bool
	cmd := &cobra.Command{
		Use:   "set -f FILE",
		Short: "Replace the config with a JSON or YAML document (- reads stdin)",
		Long: "Replace the config. FILE (JSON, or YAML with the same keys) holds either\n" +
			"the bare document or the output of\n" +
			"`config get` ({\"version\",\"config\"}); with the latter the write is a\n" +
			"compare-and-set on that version unless --force.",
		Args: cobra.NoArgs,
		RunE: func(cmd *cobra.Command, _ []string) error {
			if file == "" {
				return errors.New("config set needs -f FILE (or -f - for stdin)")
			}
			data, err := readInput(cmd.InOrStdin(), file)
			if err != nil {
				return err
			}
			if data, err = yamlToJSON(data); err != nil {
				return err
			}
			doc, ver, err := unwrap(data)
			if err != nil {
				return err
			}
			var exp *uint64
			switch {
			case expected >= 0:
				exp = config.Version(uint64(expected))
			case ver != nil && !force:
				exp = ver
			}
			if _, err := config.ParseDocument(doc); err != nil {
				return err // the same field-named error the server would give, without a round trip
			}
			return c.call(cmd, func(ctx context.Context, cl *config.Client) error {
				v, err := cl.SetConfigJSON(ctx, doc, exp)
				if err != nil {
					return err
				}
				fmt.Fprintf(cmd.OutOrStdout(), "applied version %d\n", v)
				return nil
			})
		},
	}
	c.bind(cmd)
	cmd.Flags().StringVarP(&file, "file", "f", "", "JSON file with the config (- for stdin)")
	cmd.Flags().Int64Var(&expected, "expected-version", -1, "compare-and-set: only replace this version")
	cmd.Flags().BoolVar(&force, "force", false, "ignore the version in a {\"version\",\"config\"} file")
	return cmd
}

func newPatchCmd() *cobra.Command {
	var c conn
	var expected int64
	cmd := &cobra.Command{
		Use:   "patch PATCH",
		Short: "Apply an RFC 7386 JSON merge patch, e.g. '{\"prefix_cache\":{\"imbalance_abs_count\":8}}'",
		Args:  cobra.ExactArgs(1),
		RunE: func(cmd *cobra.Command, args []string) error {
			return c.call(cmd, func(ctx context.Context, cl *config.Client) error {
				var exp *uint64
				if expected >= 0 {
					exp = config.Version(uint64(expected))
				}
				v, err := cl.PatchConfig(ctx, []byte(args[0]), exp)
				if err != nil {
					return err
				}
				fmt.Fprintf(cmd.OutOrStdout(), "applied version %d\n", v)
				return nil
			})
		},
	}
	c.bind(cmd)
	cmd.Flags().Int64Var(&expected, "expected-version", -1, "compare-and-set: only patch this version")
	return cmd
}

// maxConflictRetries bounds how often edit re-applies the user's change
// on top of a config someone else changed meanwhile.
const maxConflictRetries = 5

// maxEdits bounds how often edit reopens the editor after a validation
// error.
const maxEdits = 5

func newEditCmd() *cobra.Command {
	var c conn
	cmd := &cobra.Command{
		Use:   "edit",
		Short: "Edit the config in $EDITOR; validated, applied as a merge patch, retried on version conflict",
		Long: "Opens the applied config in $VISUAL or $EDITOR (default vi). On save the\n" +
			"document is validated (an invalid one reopens the editor with the error\n" +
			"printed), then your changes are applied as a merge patch with a\n" +
			"compare-and-set on the version you edited. If someone else changed the\n" +
			"config meanwhile, your changes are re-applied on top of theirs (up to 5\n" +
			"times) and validated again.",
		Args: cobra.NoArgs,
		RunE: func(cmd *cobra.Command, _ []string) error {
			cl, err := c.dial()
			if err != nil {
				return err
			}
			defer cl.Close()
			return c.explain(cmd, edit(cmd, &c, cl))
		},
	}
	c.bind(cmd)
	return cmd
}

func edit(cmd *cobra.Command, c *conn, cl *config.Client) error {
	ctx, cancel := c.ctx(cmd.Context())
	cur, err := cl.GetConfig(ctx)
	cancel()
	if err != nil {
		return err
	}
	base := config.DefaultRoutingConfig()
	if cur.Config != nil {
		base = *cur.Config
	}
	orig, err := config.MarshalDocument(&base)
	if err != nil {
		return err
	}
	f, err := os.CreateTemp("", "kvmesh-config-*.json")
	if err != nil {
		return err
	}
	path := f.Name()
	defer os.Remove(path)
	if err := f.Close(); err != nil {
		return err
	}
	text := orig
	for attempt := 1; ; attempt++ {
		if err := os.WriteFile(path, text, 0o600); err != nil {
			return err
		}
		if err := runEditor(cmd, path); err != nil {
			return err
		}
		edited, err := os.ReadFile(path)
		if err != nil {
			return err
		}
		if bytes.Equal(bytes.TrimSpace(edited), bytes.TrimSpace(orig)) {
			fmt.Fprintln(cmd.OutOrStdout(), "no changes")
			return nil
		}
		_, verr := config.ParseDocument(edited)
		if verr == nil {
			patch, err := config.MakeMergePatch(orig, edited)
			if err != nil {
				return err
			}
			v, err := applyWithRetry(cmd, c, cl, patch, cur.Version)
			if err == nil {
				fmt.Fprintf(cmd.OutOrStdout(), "applied version %d\n", v)
				return nil
			}
			if !errors.Is(err, config.ErrInvalidConfig) {
				return err
			}
			verr = err
		}
		if attempt >= maxEdits {
			return fmt.Errorf("giving up after %d edits: %w", attempt, verr)
		}
		fmt.Fprintf(cmd.ErrOrStderr(), "invalid config, reopening the editor:\n%v\n", verr)
		text = edited
	}
}

// applyWithRetry applies patch with a compare-and-set on version; on a
// conflict it re-reads the version and tries again.
func applyWithRetry(cmd *cobra.Command, c *conn, cl *config.Client, patch []byte, version uint64) (uint64, error) {
	for try := 0; ; try++ {
		ctx, cancel := c.ctx(cmd.Context())
		v, err := cl.PatchConfig(ctx, patch, config.Version(version))
		cancel()
		if err == nil || !errors.Is(err, config.ErrVersionConflict) || try >= maxConflictRetries {
			return v, err
		}
		ctx, cancel = c.ctx(cmd.Context())
		cur, gerr := cl.GetConfig(ctx)
		cancel()
		if gerr != nil {
			return 0, gerr
		}
		fmt.Fprintf(cmd.ErrOrStderr(), "config changed meanwhile (version %d → %d); re-applying your changes on top\n", version, cur.Version)
		version = cur.Version
	}
}

func runEditor(cmd *cobra.Command, path string) error {
	editor := os.Getenv("VISUAL")
	if editor == "" {
		editor = os.Getenv("EDITOR")
	}
	if editor == "" {
		editor = "vi"
	}
	// Through the shell, so EDITOR may carry arguments ("code --wait").
	ed := exec.CommandContext(cmd.Context(), "sh", "-c", editor+` "$1"`, "sh", path)
	ed.Stdin, ed.Stdout, ed.Stderr = os.Stdin, cmd.OutOrStdout(), cmd.ErrOrStderr()
	if err := ed.Run(); err != nil {
		return fmt.Errorf("editor %q: %w", editor, err)
	}
	return nil
}

// NewMembersCmd returns "members".
func NewMembersCmd() *cobra.Command {
	var c conn
	var asJSON bool
	cmd := &cobra.Command{
		Use:   "members",
		Short: "List the cluster's gateways with their raft role",
		Args:  cobra.NoArgs,
		RunE: func(cmd *cobra.Command, _ []string) error {
			return c.call(cmd, func(ctx context.Context, cl *config.Client) error {
				resp, err := cl.Members(ctx)
				if err != nil {
					return err
				}
				if asJSON {
					return printJSON(cmd.OutOrStdout(), resp.Members)
				}
				return printMembers(cmd.OutOrStdout(), resp.Members)
			})
		},
	}
	c.bind(cmd)
	cmd.Flags().BoolVar(&asJSON, "json", false, "print JSON")
	return cmd
}

func printMembers(out io.Writer, ms []*adminpb.Member) error {
	tw := tabwriter.NewWriter(out, 0, 4, 2, ' ', 0)
	fmt.Fprintln(tw, "ID\tROLE\tLEADER\tALIVE\tRAFT\tADMIN")
	for _, m := range ms {
		role := strings.ToLower(strings.TrimPrefix(m.Suffrage.String(), "SUFFRAGE_"))
		leader := ""
		if m.Leader {
			leader = "*"
		}
		fmt.Fprintf(tw, "%s\t%s\t%s\t%t\t%s\t%s\n", m.Id, role, leader, m.Alive, m.RaftAddr, m.AdminAddr)
	}
	return tw.Flush()
}

// NewExplainCmd returns "explain", answered by the gateway's admin API.
func NewExplainCmd() *cobra.Command {
	var c conn
	var model, prompt, promptFile, strategy, body string
	cmd := &cobra.Command{
		Use:   "explain --model M --prompt P",
		Short: "Explain how the gateway would route a prompt (per-replica match, load, score)",
		Args:  cobra.NoArgs,
		RunE: func(cmd *cobra.Command, _ []string) error {
			req := &adminpb.ExplainRouteRequest{Model: model, Prompt: prompt, Strategy: strategy}
			if promptFile != "" {
				p, err := readInput(cmd.InOrStdin(), promptFile)
				if err != nil {
					return err
				}
				req.Prompt = string(p)
			}
			if body != "" {
				b, err := readInput(cmd.InOrStdin(), body)
				if err != nil {
					return err
				}
				req.RequestJson = b
			}
			if req.Model == "" && len(req.RequestJson) == 0 {
				return errors.New("explain needs --model (with --prompt or --prompt-file) or --body")
			}
			return c.call(cmd, func(ctx context.Context, cl *config.Client) error {
				rep, err := cl.ExplainRoute(ctx, req)
				if err != nil {
					return err
				}
				var pretty bytes.Buffer
				if json.Indent(&pretty, rep, "", "  ") != nil {
					pretty.Reset()
					pretty.Write(rep)
				}
				pretty.WriteByte('\n')
				_, err = cmd.OutOrStdout().Write(pretty.Bytes())
				return err
			})
		},
	}
	c.bind(cmd)
	fl := cmd.Flags()
	fl.StringVar(&model, "model", "", "model name")
	fl.StringVar(&prompt, "prompt", "", "prompt text")
	fl.StringVar(&promptFile, "prompt-file", "", "file holding the prompt (- for stdin)")
	fl.StringVar(&strategy, "strategy", "", "strategy to explain (default: the model's)")
	fl.StringVar(&body, "body", "", "file with a full completions/chat request body (- for stdin)")
	return cmd
}

func readInput(stdin io.Reader, name string) ([]byte, error) {
	if name == "-" {
		return io.ReadAll(stdin)
	}
	return os.ReadFile(name)
}

// unwrap accepts a bare document or a {"version","config"} wrapper and
// returns the document and, for a wrapper, its version.
func unwrap(data []byte) ([]byte, *uint64, error) {
	var probe map[string]json.RawMessage
	if err := json.Unmarshal(data, &probe); err != nil {
		return nil, nil, fmt.Errorf("%w: %w", config.ErrInvalidConfig, err)
	}
	cfg, hasCfg := probe["config"]
	ver, hasVer := probe["version"]
	if !hasCfg || !hasVer || len(probe) != 2 {
		return data, nil, nil
	}
	var v uint64
	if err := json.Unmarshal(ver, &v); err != nil {
		return nil, nil, fmt.Errorf("%w: version: %w", config.ErrInvalidConfig, err)
	}
	return cfg, &v, nil
}

// yamlToJSON converts a YAML document to JSON; JSON input (starting with
// '{') is returned as is.
func yamlToJSON(data []byte) ([]byte, error) {
	if t := bytes.TrimSpace(data); len(t) > 0 && t[0] == '{' {
		return data, nil
	}
	var v any
	if err := yaml.Unmarshal(data, &v); err != nil {
		return nil, fmt.Errorf("%w: yaml: %w", config.ErrInvalidConfig, err)
	}
	out, err := json.Marshal(v)
	if err != nil {
		return nil, fmt.Errorf("%w: yaml: %w", config.ErrInvalidConfig, err)
	}
	return out, nil
}

func printJSON(out io.Writer, v any) error {
	enc := json.NewEncoder(out)
	enc.SetIndent("", "  ")
	return enc.Encode(v)
}
