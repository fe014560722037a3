package main

import (
	"reflect"
	"strings"

	"github.com/spf13/pflag"

	"github.com/kvmesh/kvmesh/route"
)

// routeFlag is one strategy parameter settable on the serve command line:
// --prefix-cache-*, --consistent-hash-* and --cost-*, named after route's
// keys, which the gateway YAML and the cluster document share
// (prefix_cache.stddev_factor ↔ --prefix-cache-stddev-factor), so a knob
// has one name wherever it is set: flag, YAML and the admin API.
type routeFlag struct {
	name    string // flag name
	yamlKey string // the YAML key (cost.alpha), the same in the cluster document
	section int    // field index in route.Config
	field   int    // field index in the section's struct
}

// routeSections are route.Config's parameter structs, by Go field name.
var routeSections = []string{"PrefixCache", "ConsistentHash", "Cost"}

// addRouteFlags registers one flag per strategy parameter of *d (its
// current values are the defaults shown), with route's doc comment as the
// usage, and returns them.
func addRouteFlags(fl *pflag.FlagSet, d *route.Config) []routeFlag {
	docs, _ := fieldDocs(route.Sources()...)
	rv := reflect.ValueOf(d).Elem()
	var out []routeFlag
	for _, goName := range routeSections {
		sf, ok := rv.Type().FieldByName(goName)
		if !ok {
			continue
		}
		section, _, _ := strings.Cut(sf.Tag.Get("yaml"), ",")
		sv := rv.FieldByIndex(sf.Index)
		for j := 0; j < sv.NumField(); j++ {
			f := sv.Type().Field(j)
			key, _, _ := strings.Cut(f.Tag.Get("yaml"), ",")
			if key == "" || key == "-" || !f.IsExported() {
				continue
			}
			name := strings.ReplaceAll(section+"_"+key, "_", "-")
			usage := docs[sv.Type().Name()+"."+f.Name]
			if i := strings.Index(usage, ". "); i > 0 {
				usage = usage[:i+1] // the first sentence; docs/config.md has the rest
			}
			if usage == "" {
				usage = "see go doc github.com/kvmesh/kvmesh/route " + sv.Type().Name()
			}
			usage = "(YAML and cluster document " + section + "." + key + ") " + usage
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
				yamlKey: section + "." + key})
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
