package live

import (
	"context"
	"errors"
	"fmt"
	"net"
	"net/http"
	"net/http/httputil"
	"net/url"
	"time"

	"github.com/kvmesh/kvmesh/chaos/extproc"
)

// plane is one data plane in front of the gateways' pickers.
type plane struct {
	dp  *extproc.DataPlane
	srv *http.Server
}

func (p *plane) close() error {
	ctx, cancel := context.WithTimeout(context.Background(), 5*time.Second)
	defer cancel()
	return errors.Join(p.srv.Shutdown(ctx), p.dp.Close())
}

// startDataPlanes starts a data plane per gateway, asking that gateway's
// picker first and the others in turn, and returns their URLs.
func (w *World) startDataPlanes() ([]string, error) {
	var urls []string
	for g := range w.nodes {
		var pickers []string
		for i := range w.nodes {
			pickers = append(pickers, w.nodes[(g+i)%len(w.nodes)].EPPAddr())
		}
		dp, err := extproc.New(extproc.Config{Pickers: pickers, TLS: true})
		if err != nil {
			return nil, fmt.Errorf("live: data plane %d: %w", g, err)
		}
		ln, err := net.Listen("tcp", "127.0.0.1:0")
		if err != nil {
			_ = dp.Close()
			return nil, fmt.Errorf("live: data plane %d: %w", g, err)
		}
		// The gateway's own /metrics stays on its HTTP port, scraped
		// there as an operator would; the plane serves the rest.
		mux := http.NewServeMux()
		mux.Handle("/", dp)
		mux.Handle("/metrics", httputil.NewSingleHostReverseProxy(&url.URL{Scheme: "http", Host: w.nodes[g].HTTPAddr()}))
		p := &plane{dp: dp, srv: &http.Server{Handler: mux, ReadHeaderTimeout: 10 * time.Second}}
		go func() { _ = p.srv.Serve(ln) }()
		w.planes = append(w.planes, p)
		urls = append(urls, "http://"+ln.Addr().String())
	}
	return urls, nil
}
