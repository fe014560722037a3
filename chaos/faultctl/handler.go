package faultctl

import (
	"crypto/sha256"
	"crypto/subtle"
	"encoding/json"
	"errors"
	"fmt"
	"net/http"
	"strings"
)

// maxBody bounds a request body.
const maxBody = 64 << 10

// Handler serves the control API on m (see the package doc). token must
// be non-empty: every route but /healthz needs "Authorization: Bearer
// token"; a request without it gets 401.
func Handler(m *Manager, token string) (http.Handler, error) {
	if token == "" {
		return nil, fmt.Errorf("%w: empty control token", ErrInvalid)
	}
	want := sha256.Sum256([]byte(token))
	mux := http.NewServeMux()
	mux.HandleFunc("GET /healthz", func(w http.ResponseWriter, _ *http.Request) { _, _ = w.Write([]byte("ok\n")) })
	auth := func(h func(*http.Request) (int, any, error)) http.HandlerFunc {
		return func(w http.ResponseWriter, r *http.Request) {
			got, ok := strings.CutPrefix(r.Header.Get("Authorization"), "Bearer ")
			sum := sha256.Sum256([]byte(got))
			if !ok || subtle.ConstantTimeCompare(sum[:], want[:]) != 1 {
				writeJSON(w, http.StatusUnauthorized, errorBody{Error: ErrUnauthorized.Error()})
				return
			}
			code, body, err := h(r)
			if err != nil {
				writeJSON(w, statusOf(err), errorBody{Error: err.Error()})
				return
			}
			writeJSON(w, code, body)
		}
	}
	mux.HandleFunc("GET /v1/proxies", auth(func(*http.Request) (int, any, error) { return 200, m.List(), nil }))
	mux.HandleFunc("POST /v1/proxies", auth(func(r *http.Request) (int, any, error) {
		var s ProxySpec
		if err := decode(r, &s); err != nil {
			return 0, nil, err
		}
		pi, err := m.Create(s)
		return http.StatusCreated, pi, err
	}))
	mux.HandleFunc("GET /v1/proxies/{name}", auth(func(r *http.Request) (int, any, error) {
		pi, err := m.Get(r.PathValue("name"))
		return 200, pi, err
	}))
	mux.HandleFunc("DELETE /v1/proxies/{name}", auth(func(r *http.Request) (int, any, error) {
		return 200, struct{}{}, m.Delete(r.PathValue("name"))
	}))
	mux.HandleFunc("POST /v1/proxies/{name}/faults", auth(func(r *http.Request) (int, any, error) {
		var s FaultSpec
		if err := decode(r, &s); err != nil {
			return 0, nil, err
		}
		fi, err := m.AddFault(r.PathValue("name"), s)
		return http.StatusCreated, fi, err
	}))
	mux.HandleFunc("DELETE /v1/proxies/{name}/faults", auth(func(r *http.Request) (int, any, error) {
		return 200, struct{}{}, m.Heal(r.PathValue("name"))
	}))
	mux.HandleFunc("DELETE /v1/proxies/{name}/faults/{fault}", auth(func(r *http.Request) (int, any, error) {
		return 200, struct{}{}, m.RemoveFault(r.PathValue("name"), r.PathValue("fault"))
	}))
	mux.HandleFunc("POST /v1/proxies/{name}/cut", auth(func(r *http.Request) (int, any, error) {
		n, err := m.Cut(r.PathValue("name"))
		return 200, ActionResult{Connections: n}, err
	}))
	mux.HandleFunc("POST /v1/proxies/{name}/half-open", auth(func(r *http.Request) (int, any, error) {
		n, err := m.HalfOpen(r.PathValue("name"))
		return 200, ActionResult{Connections: n}, err
	}))
	return mux, nil
}

// ActionResult answers cut and half-open: the connections acted on.
type ActionResult struct {
	Connections int `json:"connections"`
}

type errorBody struct {
	Error string `json:"error"`
}

func decode(r *http.Request, v any) error {
	dec := json.NewDecoder(http.MaxBytesReader(nil, r.Body, maxBody))
	dec.DisallowUnknownFields()
	if err := dec.Decode(v); err != nil {
		return fmt.Errorf("%w: body: %w", ErrInvalid, err)
	}
	return nil
}

func statusOf(err error) int {
	switch {
	case errors.Is(err, ErrInvalid):
		return http.StatusBadRequest
	case errors.Is(err, ErrNotFound):
		return http.StatusNotFound
	case errors.Is(err, ErrExists), errors.Is(err, ErrConflict):
		return http.StatusConflict
	case errors.Is(err, ErrClosed):
		return http.StatusServiceUnavailable
	}
	return http.StatusInternalServerError
}

func writeJSON(w http.ResponseWriter, code int, v any) {
	w.Header().Set("Content-Type", "application/json")
	w.WriteHeader(code)
	_ = json.NewEncoder(w).Encode(v)
}
