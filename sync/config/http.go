package config

import (
	"encoding/json"
	"errors"
	"fmt"
	"io"
	"net/http"
	"strconv"
	"strings"
)

// Handler returns the HTTP/JSON admin API, for curl users. Every route
// needs "Authorization: Bearer <token>" (reads are open when
// AllowUnauthenticatedReads is set). Mount it at the root of a mux
// (mux.Handle("/admin/", srv.Handler())).
//
//	GET    /admin/v1/config                         {"version":N,"config":{...}}; ETag: "N"
//	PUT    /admin/v1/config                         body: the document; If-Match: "N" for compare-and-set
//	PATCH  /admin/v1/config                         body: RFC 7386 merge patch; If-Match as above
//	POST   /admin/v1/models/{model}/replicas        body: {"name","url","kv","kv_bind","replay"}
//	DELETE /admin/v1/models/{model}/replicas/{name}
//	GET    /admin/v1/members                        cluster view with raft roles
//	GET    /admin/v1/status                         this node's raft view
//	GET    /admin/v1/index/stats                    index summary
//	GET    /admin/v1/explain?model=&prompt=&strategy=   POST: a completions/chat body
//	GET    /admin/v1/snapshot                       index snapshot (application/octet-stream)
//
// Writes answer {"version":N}. Errors answer {"error":{"message","type",
// "code"}} with a stable code: invalid_config (400), bad_request (400),
// version_conflict (409), not_found (404), no_quorum (503),
// unauthenticated (401), not_available (501), internal_error (500).
func (s *Server) Handler() http.Handler {
	mux := http.NewServeMux()
	mux.HandleFunc("GET /admin/v1/config", s.read(s.httpGetConfig))
	mux.HandleFunc("PUT /admin/v1/config", s.write(s.httpPutConfig))
	mux.HandleFunc("PATCH /admin/v1/config", s.write(s.httpPatchConfig))
	mux.HandleFunc("POST /admin/v1/models/{model}/replicas", s.write(s.httpAddReplica))
	mux.HandleFunc("DELETE /admin/v1/models/{model}/replicas/{name}", s.write(s.httpRemoveReplica))
	mux.HandleFunc("GET /admin/v1/members", s.read(s.httpMembers))
	mux.HandleFunc("GET /admin/v1/status", s.read(s.httpStatus))
	mux.HandleFunc("GET /admin/v1/index/stats", s.read(s.httpIndexStats))
	mux.HandleFunc("GET /admin/v1/explain", s.read(s.httpExplain))
	mux.HandleFunc("POST /admin/v1/explain", s.read(s.httpExplain))
	mux.HandleFunc("GET /admin/v1/snapshot", s.read(s.httpSnapshot))
	return mux
}

func (s *Server) read(h http.HandlerFunc) http.HandlerFunc  { return s.guard(h, false) }
func (s *Server) write(h http.HandlerFunc) http.HandlerFunc { return s.guard(h, true) }

func (s *Server) guard(h http.HandlerFunc, write bool) http.HandlerFunc {
	return func(w http.ResponseWriter, r *http.Request) {
		if err := s.auth.check(r.Header.Get("Authorization"), write); err != nil {
			w.Header().Set("WWW-Authenticate", `Bearer realm="kvmesh-admin"`)
			s.httpError(w, err)
			return
		}
		if r.Body != nil {
			r.Body = http.MaxBytesReader(w, r.Body, s.cfg.MaxBodyBytes)
		}
		h(w, r)
	}
}

// httpStatusOf maps a package error to an HTTP status and a stable code.
func httpStatusOf(err error) (int, string) {
	switch {
	case errors.Is(err, ErrUnauthenticated):
		return http.StatusUnauthorized, "unauthenticated"
	case errors.Is(err, ErrInvalidConfig):
		return http.StatusBadRequest, "invalid_config"
	case errors.Is(err, ErrBadRequest), errors.Is(err, ErrBadCommand):
		return http.StatusBadRequest, "bad_request"
	case errors.Is(err, ErrVersionConflict):
		return http.StatusConflict, "version_conflict"
	case errors.Is(err, ErrNotFound):
		return http.StatusNotFound, "not_found"
	case errors.Is(err, ErrNoQuorum), errors.Is(err, ErrClosed):
		return http.StatusServiceUnavailable, "no_quorum"
	case errors.Is(err, ErrUnavailable):
		return http.StatusNotImplemented, "not_available"
	}
	var mbe *http.MaxBytesError
	if errors.As(err, &mbe) {
		return http.StatusRequestEntityTooLarge, "body_too_large"
	}
	return http.StatusInternalServerError, "internal_error"
}

// httpError answers err; a client error (4xx) is counted in
// kvmesh_config_admin_rejected_total{api="http",reason=<code>}.
func (s *Server) httpError(w http.ResponseWriter, err error) {
	code, name := httpStatusOf(err)
	if code >= 400 && code < 500 {
		s.reject("http", name)
	}
	typ := "invalid_request_error"
	if code >= 500 {
		typ = "server_error"
	}
	writeJSON(w, code, map[string]any{"error": map[string]string{"message": err.Error(), "type": typ, "code": name}})
}

func writeJSON(w http.ResponseWriter, code int, v any) {
	w.Header().Set("Content-Type", "application/json")
	w.WriteHeader(code)
	enc := json.NewEncoder(w)
	enc.SetIndent("", "  ")
	_ = enc.Encode(v) // the client went away: nothing to do
}

// ifMatch parses an If-Match header ("N" or N) into an expected version.
func ifMatch(r *http.Request) (*uint64, error) {
	h := strings.TrimSpace(r.Header.Get("If-Match"))
	if h == "" {
		return nil, nil
	}
	v, err := strconv.ParseUint(strings.Trim(strings.TrimPrefix(h, "W/"), `"`), 10, 64)
	if err != nil {
		return nil, fmt.Errorf("%w: If-Match %q: want a config version", ErrBadRequest, h)
	}
	return &v, nil
}

func (s *Server) httpGetConfig(w http.ResponseWriter, _ *http.Request) {
	v := s.store.Current()
	w.Header().Set("ETag", strconv.Quote(strconv.FormatUint(v.Version, 10)))
	writeJSON(w, http.StatusOK, v)
}

func (s *Server) httpPutConfig(w http.ResponseWriter, r *http.Request) {
	exp, err := ifMatch(r)
	if err != nil {
		s.httpError(w, err)
		return
	}
	body, err := io.ReadAll(r.Body)
	if err != nil {
		s.httpError(w, err)
		return
	}
	cfg, err := decodeDocument(body)
	if err != nil {
		s.httpError(w, err)
		return
	}
	s.httpApplied(w, r, SetCommand(cfg, exp))
}

func (s *Server) httpPatchConfig(w http.ResponseWriter, r *http.Request) {
	exp, err := ifMatch(r)
	if err != nil {
		s.httpError(w, err)
		return
	}
	body, err := io.ReadAll(r.Body)
	if err != nil {
		s.httpError(w, err)
		return
	}
	s.httpApplied(w, r, PatchCommand(body, exp))
}

func (s *Server) httpAddReplica(w http.ResponseWriter, r *http.Request) {
	var rep ReplicaConfig
	dec := json.NewDecoder(r.Body)
	dec.DisallowUnknownFields()
	if err := dec.Decode(&rep); err != nil {
		s.httpError(w, fmt.Errorf("%w: replica: %w", ErrBadRequest, err))
		return
	}
	s.httpApplied(w, r, AddReplicaCommand(r.PathValue("model"), rep))
}

func (s *Server) httpRemoveReplica(w http.ResponseWriter, r *http.Request) {
	s.httpApplied(w, r, RemoveReplicaCommand(r.PathValue("model"), r.PathValue("name")))
}

func (s *Server) httpApplied(w http.ResponseWriter, r *http.Request, cmd Command) {
	v, err := s.store.Apply(r.Context(), cmd)
	if err != nil {
		s.httpError(w, err)
		return
	}
	w.Header().Set("ETag", strconv.Quote(strconv.FormatUint(v, 10)))
	writeJSON(w, http.StatusOK, map[string]uint64{"version": v})
}

// memberJSON is a member's HTTP form.
type memberJSON struct {
	ID        string            `json:"id"`
	RaftAddr  string            `json:"raft_addr,omitempty"`
	AdminAddr string            `json:"admin_addr,omitempty"`
	Alive     bool              `json:"alive"`
	Suffrage  Suffrage          `json:"suffrage"`
	Leader    bool              `json:"leader,omitempty"`
	Meta      map[string]string `json:"meta,omitempty"`
}

func (s *Server) httpMembers(w http.ResponseWriter, _ *http.Request) {
	out := []memberJSON{}
	for _, m := range s.cfg.Members.Members() {
		out = append(out, memberJSON{ID: m.ID, RaftAddr: m.RaftAddr, AdminAddr: m.AdminAddr, Alive: m.Alive, Suffrage: m.Suffrage, Leader: m.Leader, Meta: m.Meta})
	}
	writeJSON(w, http.StatusOK, map[string]any{"members": out})
}

func (s *Server) httpStatus(w http.ResponseWriter, _ *http.Request) {
	st := s.store.Status()
	writeJSON(w, http.StatusOK, map[string]any{
		"node_id": st.NodeID, "state": st.State, "leader_id": st.LeaderID, "leader_raft_addr": st.LeaderRaftAddr,
		"applied_index": st.AppliedIndex, "config_version": st.ConfigVersion, "in_configuration": st.InConfiguration,
	})
}

func (s *Server) httpIndexStats(w http.ResponseWriter, r *http.Request) {
	resp, err := s.IndexStats(r.Context(), nil)
	if err != nil {
		s.httpError(w, fromStatus(err))
		return
	}
	writeJSON(w, http.StatusOK, resp)
}

func (s *Server) httpExplain(w http.ResponseWriter, r *http.Request) {
	if s.cfg.Explainer == nil {
		s.httpError(w, fmt.Errorf("%w: route explanation", ErrUnavailable))
		return
	}
	q := r.URL.Query()
	req := ExplainRequest{Model: q.Get("model"), Prompt: q.Get("prompt"), Strategy: q.Get("strategy")}
	if r.Method == http.MethodPost {
		body, err := io.ReadAll(r.Body)
		if err != nil {
			s.httpError(w, err)
			return
		}
		req.Body = body
	} else if req.Model == "" {
		s.httpError(w, fmt.Errorf("%w: model is required", ErrBadRequest))
		return
	}
	rep, err := s.cfg.Explainer.ExplainRoute(r.Context(), req)
	if err != nil {
		s.httpError(w, err)
		return
	}
	w.Header().Set("Content-Type", "application/json")
	_, _ = w.Write(rep)
}

func (s *Server) httpSnapshot(w http.ResponseWriter, r *http.Request) {
	if s.cfg.Snapshotter == nil {
		s.httpError(w, fmt.Errorf("%w: index snapshot", ErrUnavailable))
		return
	}
	w.Header().Set("Content-Type", "application/octet-stream")
	if err := s.cfg.Snapshotter.WriteIndexSnapshot(r.Context(), w); err != nil {
		// Headers may be gone already; the truncated body tells the client.
		s.log.Warn("index snapshot failed", "err", err)
	}
}
