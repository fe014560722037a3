package main

import (
	"bytes"
	"fmt"
	"go/ast"
	"go/parser"
	"go/token"
	"io"
	"os"
	"reflect"
	"strings"
	"time"

	"github.com/spf13/cobra"
	"github.com/spf13/pflag"

	"github.com/kvmesh/kvmesh/node"
	"github.com/kvmesh/kvmesh/route"
	"github.com/kvmesh/kvmesh/sync/config"
)

// newConfigReferenceCmd is `kvmesh config reference`: docs/config.md,
// generated from the config types (their YAML/JSON keys, defaults and doc
// comments) and the serve command's flags. TestConfigReferenceCurrent
// fails when the checked-in file differs.
func newConfigReferenceCmd() *cobra.Command {
	var out string
	cmd := &cobra.Command{
		Use:   "reference",
		Short: "Print the configuration reference (docs/config.md) generated from the config types",
		Args:  cobra.NoArgs,
		RunE: func(cmd *cobra.Command, _ []string) error {
			var b bytes.Buffer
			if err := writeConfigReference(&b); err != nil {
				return err
			}
			if out == "" {
				_, err := cmd.OutOrStdout().Write(b.Bytes())
				return err
			}
			return os.WriteFile(out, b.Bytes(), 0o644)
		},
	}
	cmd.Flags().StringVarP(&out, "output", "o", "", "write to this file instead of stdout (e.g. docs/config.md)")
	return cmd
}

// fieldDocs maps "Type.Field" to the field's doc comment, from Go source.
func fieldDocs(srcs ...[]byte) (map[string]string, error) {
	docs := map[string]string{}
	fset := token.NewFileSet()
	for _, src := range srcs {
		f, err := parser.ParseFile(fset, "", src, parser.ParseComments)
		if err != nil {
			return nil, err
		}
		ast.Inspect(f, func(n ast.Node) bool {
			ts, ok := n.(*ast.TypeSpec)
			if !ok {
				return true
			}
			st, ok := ts.Type.(*ast.StructType)
			if !ok {
				return false
			}
			for _, fl := range st.Fields.List {
				text := ""
				if fl.Doc != nil {
					text = fl.Doc.Text()
				} else if fl.Comment != nil {
					text = fl.Comment.Text()
				}
				for _, name := range fl.Names {
					docs[ts.Name.Name+"."+name.Name] = oneParagraph(text)
				}
			}
			return false
		})
	}
	return docs, nil
}

// oneParagraph joins a doc comment's lines into one table cell, escaping
// the table separator.
func oneParagraph(text string) string {
	s := strings.Join(strings.Fields(text), " ")
	return strings.ReplaceAll(s, "|", `\|`)
}

// refRow is one knob of a reference table.
type refRow struct {
	key, typ, def, flag, doc string
}

// walk lists the leaf fields of v (a struct) under prefix, keyed by the
// tag (yaml or json) a file or document uses.
func walk(v reflect.Value, prefix, tag string, docs map[string]string, rows *[]refRow) {
	t := v.Type()
	for i := 0; i < t.NumField(); i++ {
		f := t.Field(i)
		if !f.IsExported() {
			continue
		}
		name, opts, _ := strings.Cut(f.Tag.Get(tag), ",")
		if name == "-" || f.Type.String() == "yaml.Node" { // yaml.Node: a catch for old keys
			continue
		}
		if (f.Anonymous && name == "") || opts == "inline" {
			// Embedded (JSON) or inlined (YAML): its keys are the parent's.
			walk(v.Field(i), prefix, tag, docs, rows)
			continue
		}
		if name == "" {
			name = strings.ToLower(f.Name) // yaml.v3's default key
		}
		key := prefix + name
		doc := docs[t.Name()+"."+f.Name]
		fv := v.Field(i)
		ft := f.Type
		switch {
		case ft.Kind() == reflect.Struct && ft != reflect.TypeOf(time.Duration(0)) && ft.Name() != "Duration":
			if ft.PkgPath() != t.PkgPath() {
				doc += " (`go doc " + ft.PkgPath() + " " + ft.Name() + "`)"
			}
			*rows = append(*rows, refRow{key: key, typ: "object", doc: strings.TrimSpace(doc)})
			walk(fv, key+".", tag, docs, rows)
		case ft.Kind() == reflect.Slice && ft.Elem().Kind() == reflect.Struct:
			*rows = append(*rows, refRow{key: key + "[]", typ: "list", doc: doc})
			walk(reflect.New(ft.Elem()).Elem(), key+"[].", tag, docs, rows)
		case ft.Kind() == reflect.Map && ft.Elem().Kind() == reflect.Struct:
			*rows = append(*rows, refRow{key: key + ".NAME", typ: "map", doc: doc})
			walk(reflect.New(ft.Elem()).Elem(), key+".NAME.", tag, docs, rows)
		default:
			*rows = append(*rows, refRow{key: key, typ: typeName(ft), def: defaultText(fv), doc: doc})
		}
	}
}

func typeName(t reflect.Type) string {
	switch {
	case t == reflect.TypeOf(time.Duration(0)), t.Name() == "Duration":
		return "duration"
	case t.Kind() == reflect.Slice:
		return "list of " + typeName(t.Elem())
	}
	return t.Kind().String()
}

func defaultText(v reflect.Value) string {
	switch {
	case v.Type() == reflect.TypeOf(time.Duration(0)):
		return "`" + time.Duration(v.Int()).String() + "`"
	case v.Type().Name() == "Duration" && v.Kind() == reflect.Int64:
		return "`" + time.Duration(v.Int()).String() + "`"
	case v.Kind() == reflect.String:
		if v.String() == "" {
			return `""`
		}
		return "`" + v.String() + "`"
	case v.Kind() == reflect.Slice:
		if v.Len() == 0 {
			return "[]"
		}
	}
	return fmt.Sprintf("`%v`", v.Interface())
}

// gatewayFlag names the serve flag that sets a gateway YAML key, if any:
// the key's last part with dashes (http_addr → --http-addr), or with the
// cluster- prefix for cluster.* keys whose short name is taken.
func gatewayFlag(fs *pflag.FlagSet, key string) string {
	for _, rf := range addRouteFlags(pflag.NewFlagSet("", pflag.ContinueOnError), new(route.Config)) {
		if rf.yamlKey == key {
			return "`--" + rf.name + "`"
		}
	}
	if strings.Contains(key, "[]") {
		return ""
	}
	last := key[strings.LastIndex(key, ".")+1:]
	cands := []string{strings.ReplaceAll(last, "_", "-")}
	if f, ok := sectionFlags[key]; ok {
		cands = []string{f}
	} else if sec, rest, ok := strings.Cut(key, "."); ok && (sec == "epp" || sec == "discovery") && !strings.Contains(rest, ".") {
		cands = []string{sec + "-" + strings.ReplaceAll(rest, "_", "-")} // epp.addr → --epp-addr
	} else if rest, ok := strings.CutPrefix(key, "discovery.kubernetes."); ok && rest != "kubeconfig" {
		cands = []string{"k8s-" + strings.ReplaceAll(rest, "_", "-")} // → --k8s-inference-pool
	}
	if parts := strings.Split(key, "."); len(parts) == 3 && parts[0] == "cluster" {
		// cluster.admin_tls.cert_file → --admin-tls-cert
		sec, ok := strings.CutSuffix(parts[1], "_tls")
		file, ok2 := strings.CutSuffix(parts[2], "_file")
		if !ok || !ok2 {
			return ""
		}
		cands = []string{strings.ReplaceAll(sec, "_", "-") + "-tls-" + file}
	} else if strings.HasPrefix(key, "cluster.") {
		cands = append([]string{"cluster-" + cands[0]}, cands...)
		switch key {
		case "cluster.enabled":
			cands = []string{"cluster"}
		case "cluster.advertise_addr":
			cands = []string{"advertise-addr"}
		}
	}
	for _, c := range cands {
		if fs.Lookup(c) != nil && !(strings.HasPrefix(key, "cluster.") && c == "tokenizer") {
			return "`--" + c + "`"
		}
	}
	return ""
}

// sectionFlags are the gateway YAML keys whose flag the rules of
// gatewayFlag do not find.
var sectionFlags = map[string]string{
	"discovery.source": "discovery",
	"epp.cert_file":    "epp-tls-cert",
	"epp.key_file":     "epp-tls-key",
}

// documentToGateway maps a cluster document key to the gateway YAML key
// and flag that seed it when the cluster config is first written.
var documentToGateway = map[string]string{
	"strategy":                         "strategy",
	"index_mode":                       "index_mode",
	"hash_seed":                        "hash_seed",
	"prefix_cache.block_size":          "block_size",
	"prefix_cache.tokenizer":           "tokenizer",
	"prefix_cache.imbalance_abs_count": "prefix_cache.imbalance_abs_count",
	"prefix_cache.stddev_factor":       "prefix_cache.stddev_factor",
	"prefix_cache.local_load":          "prefix_cache.local_load",
	"index.capacity":                   "index_capacity",
	"index.history_ttl":                "history_ttl",
	"index.speculative_ttl":            "speculative_ttl",
	"peer_load_delay_seconds":          "peer_load_delay_seconds",
}

func writeConfigReference(w io.Writer) error {
	ndocs, err := fieldDocs(node.ConfigSources()...)
	if err != nil {
		return err
	}
	cdocs, err := fieldDocs(config.DocumentSource())
	if err != nil {
		return err
	}
	// The strategies' parameters are defined and described once, in
	// route; the cluster document and the gateway YAML both use route's
	// types, under the same keys.
	rdocs, err := fieldDocs(route.Sources()...)
	if err != nil {
		return err
	}
	for k, v := range rdocs {
		if ndocs[k] == "" {
			ndocs[k] = v
		}
		if cdocs[k] == "" {
			cdocs[k] = v
		}
	}
	serveCmd, _ := newServeCmdFlags()
	fs := serveCmd.Flags()

	var gw []refRow
	walk(reflect.ValueOf(node.DefaultConfig()), "", "yaml", ndocs, &gw)
	for i := range gw {
		gw[i].flag = gatewayFlag(fs, gw[i].key)
	}
	gwKeys := map[string]bool{}
	for _, r := range gw {
		gwKeys[r.key] = true
	}
	var doc []refRow
	walk(reflect.ValueOf(config.DefaultRoutingConfig()), "", "json", cdocs, &doc)
	for i := range doc {
		k := doc[i].key
		g, ok := documentToGateway[k]
		if !ok && (strings.HasPrefix(k, "cost.") || strings.HasPrefix(k, "consistent_hash.")) {
			// route.Config's keys are the same in both: one schema.
			g, ok = k, true
		}
		if ok && gwKeys[g] {
			doc[i].flag = "`" + g + "`"
			if f := gatewayFlag(fs, g); f != "" {
				doc[i].flag += ", " + f
			}
		}
	}

	p := func(format string, args ...any) { fmt.Fprintf(w, format, args...) }
	p("# Configuration reference\n\n")
	p("<!-- Generated by `kvmesh config reference -o docs/config.md` from the config types\n")
	p("     (node.Config, sync/config.RoutingConfig) and their doc comments. Do not edit:\n")
	p("     TestConfigReferenceCurrent fails when this file is stale. -->\n\n")
	p("A gateway reads its configuration from, in order of precedence: the\n")
	p("`kvmesh serve` flags given on the command line, the YAML file of\n")
	p("`--config`, then the defaults below. In cluster mode the routing knobs\n")
	p("live in the raft-replicated **cluster document** (second table): the\n")
	p("first gateway seeds it from its own configuration, and afterwards\n")
	p("`kvmesh config get|set|patch|edit` or the admin API\n")
	p("(`/admin/v1/config`) change it on every gateway at once; a key of the\n")
	p("document wins over the gateway's own value for the same knob.\n\n")
	p("Durations are Go durations (`250ms`, `2s`, `1h30m`).\n\n")
	p("## Gateway: YAML file and flags\n\n")
	p("Keys of the `--config` YAML file (unknown keys are refused). `models[]`\n")
	p("are the replica pools; `--model` and `--replica name=url[,kv=...][,kv-bind=...][,replay=...][,model=...][,dp=N]`\n")
	p("add to them from the command line.\n\n")
	table(w, "YAML key", "flag", gw)
	p("\n## Cluster document: `kvmesh config`, admin API\n\n")
	p("The JSON document `kvmesh config get` prints under `config` (YAML with\n")
	p("the same keys is accepted by `config set`). The last column names the\n")
	p("gateway YAML key (and flag) that seeds the knob when the cluster's\n")
	p("document is first written.\n\n")
	table(w, "document key", "seeded from", doc)
	return nil
}

func table(w io.Writer, keyHead, flagHead string, rows []refRow) {
	fmt.Fprintf(w, "| %s | type | default | %s | description |\n|---|---|---|---|---|\n", keyHead, flagHead)
	for _, r := range rows {
		fmt.Fprintf(w, "| `%s` | %s | %s | %s | %s |\n", r.key, r.typ, r.def, r.flag, r.doc)
	}
}
