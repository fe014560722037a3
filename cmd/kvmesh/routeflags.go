package main

import (
	"reflect"
	"strings"

	"github.com/spf13/pflag"

	"github.com/kvmesh/kvmesh/route"
	"github.com/kvmesh/kvmesh/sync/config"
)

// routeFlag is one strategy parameter settable on the serve command line:
// --prefix-cache-*, --consistent-hash-* and --cost-*, named after the
// cluster document's keys (prefix_cache.stddev_factor ↔
// --prefix-cache-stddev-factor), so a knob has one name wherever it is
// set: flag, YAML (route: ...) and the admin API.
type routeFlag struct {
	name    string // flag name
	yamlKey string // the gateway YAML key (route.cost.alpha)
	section int    // field index in route.Config
	field   int    // field index in the section's struct
}

// routeSections are route.Config's parameter structs and the cluster
// document's mirrors of them (same field names, JSON keys).
var routeSections = []struct {
	goName, docKey string
	mirror         reflect.Type
}{
	{"PrefixCache", "prefix_cache", reflect.TypeOf(config.PrefixCacheConfig{})},
	{"ConsistentHash", "consistent_hash", reflect.TypeOf(config.ConsistentHashConfig{})},
	{"Cost", "cost", reflect.TypeOf(config.CostConfig{})},
}

// addRouteFlags registers one flag per strategy parameter of *d (its
// current values are the defaults shown), with route's doc comment as the
// usage, and returns them.
func addRouteFlags(fl *pflag.FlagSet, d *route.Config) []routeFlag {
	docs, _ := fieldDocs(route.Sources()...)
	rv := reflect.ValueOf(d).Elem()
	var out []routeFlag
	for _, sec := range routeSections {
		sf, ok := rv.Type().FieldByName(sec.goName)
		if !ok {
			continue
		}
		sv := rv.FieldByIndex(sf.Index)
		for j := 0; j < sv.NumField(); j++ {
			f := sv.Type().Field(j)
			mf, ok := sec.mirror.FieldByName(f.Name)
			if !ok || !f.IsExported() {
				continue
			}
			key, _, _ := strings.Cut(mf.Tag.Get("json"), ",")
			name := strings.ReplaceAll(sec.docKey+"_"+key, "_", "-")
			usage := docs[sv.Type().Name()+"."+f.Name]
			if i := strings.Index(usage, ". "); i > 0 {
				usage = usage[:i+1] // the first sentence; docs/config.md has the rest
			}
			if usage == "" {
				usage = "see go doc github.com/kvmesh/kvmesh/route " + sv.Type().Name()
			}
			usage = "(cluster document " + sec.docKey + "." + key + ") " + usage
			p := sv.Field(j).Addr().Interface()
			switch v := p.(type) {
			case *int:
				fl.IntVar(v, name, *v, usage)
			case *float64:
				fl.Float64Var(v, name, *v, usage)
			case *bool:
				fl.BoolVar(v, name, *v, usage)
			default:
				continue
			}
			out = append(out, routeFlag{name: name, section: sf.Index[0], field: j,
				yamlKey: "route." + strings.ToLower(sec.goName) + "." + strings.ToLower(f.Name)})
		}
	}
	return out
}

// apply copies the flags given on the command line from src into dst.
func applyRouteFlags(fs *pflag.FlagSet, flags []routeFlag, dst *route.Config, src route.Config) {
	dv, sv := reflect.ValueOf(dst).Elem(), reflect.ValueOf(src)
	for _, f := range flags {
		if fs.Changed(f.name) {
			dv.Field(f.section).Field(f.field).Set(sv.Field(f.section).Field(f.field))
		}
	}
}
