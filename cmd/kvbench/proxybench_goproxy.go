package main

import (
	"bytes"
	"errors"
	"fmt"
	"io"
	"net"
	"net/http"
	"net/http/httputil"
	"net/url"
	"sync/atomic"
	"time"

	"github.com/spf13/cobra"
)

// The Go floor (proxybench --go-floor) is the least a Go proxy does: the
// standard library's httputil.ReverseProxy, round-robin over the engines,
// flushing every write (FlushInterval −1; ReverseProxy does so for a
// stream of unknown length or an event stream anyway), with keep-alive
// upstream connections as nginx's and kvmesh's. It parses no body, keys
// nothing and routes nothing (it reads each request body whole before
// forwarding it, as kvmesh must). Measured in the same run, it separates
// what kvmesh's own work adds from what a Go HTTP server and client on the
// same cores cost anyway (goroutine wake-ups, the runtime's threads,
// net/http's buffers).

// goFloorProxy returns the floor's handler over the engine base URLs.
func goFloorProxy(engines []*url.URL) http.Handler {
	var next atomic.Uint64
	tr := &http.Transport{
		MaxIdleConnsPerHost: 1024,
		MaxIdleConns:        4096,
		IdleConnTimeout:     time.Minute,
		DisableCompression:  true,
		DialContext:         (&net.Dialer{Timeout: 5 * time.Second, KeepAlive: 30 * time.Second}).DialContext,
	}
	proxy := &httputil.ReverseProxy{
		Rewrite: func(r *httputil.ProxyRequest) {
			r.SetURL(engines[next.Add(1)%uint64(len(engines))])
		},
		Transport:     tr,
		FlushInterval: -1,
		ErrorHandler: func(w http.ResponseWriter, _ *http.Request, err error) {
			http.Error(w, err.Error(), http.StatusBadGateway)
		},
	}
	return http.HandlerFunc(func(w http.ResponseWriter, r *http.Request) {
		// The whole body first, as kvmesh reads the prompt before it
		// routes. Streamed through instead, about 8 % of answers were cut
		// short here ("ReverseProxy read error during body copy: ... use
		// of closed network connection"): the HTTP/1 server closes the
		// inbound body once the response headers go out, and the
		// transport's last read of it, after the declared length, can
		// come later and fail the upstream connection (golang/go#40747).
		b, err := io.ReadAll(r.Body)
		if err != nil {
			http.Error(w, "reading the request body: "+err.Error(), http.StatusBadRequest)
			return
		}
		r.Body, r.ContentLength = io.NopCloser(bytes.NewReader(b)), int64(len(b))
		proxy.ServeHTTP(w, r)
	})
}

func newProxybenchGoFloorCmd() *cobra.Command {
	var (
		addr      string
		upstreams []string
	)
	cmd := &cobra.Command{
		Use:    "proxybench-gofloor",
		Hidden: true,
		Args:   cobra.NoArgs,
		RunE: func(cmd *cobra.Command, _ []string) error {
			if len(upstreams) == 0 {
				return errors.New("at least one --upstream")
			}
			var engines []*url.URL
			for _, u := range upstreams {
				p, err := url.Parse(u)
				if err != nil || p.Host == "" {
					return fmt.Errorf("--upstream %q: want a base URL such as http://127.0.0.1:8001", u)
				}
				engines = append(engines, p)
			}
			return serveChild(cmd, addr, goFloorProxy(engines))
		},
	}
	f := cmd.Flags()
	f.StringVar(&addr, "addr", "127.0.0.1:0", "listen address (loopback)")
	f.StringArrayVar(&upstreams, "upstream", nil, "engine base URL (repeat; round-robin)")
	return cmd
}
