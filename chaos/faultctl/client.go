package faultctl

import (
	"bytes"
	"context"
	"encoding/json"
	"fmt"
	"io"
	"net/http"
	"strings"
)

// Client calls a control API (kvmesh faultproxy --control-addr).
type Client struct {
	// Base is the API's base URL, "http://127.0.0.1:8474".
	Base  string
	Token string
	// HTTP is the client used; nil means http.DefaultClient.
	HTTP *http.Client
}

// APIError is a non-2xx answer; Err is the sentinel its status maps to.
type APIError struct {
	Status  int
	Message string
	Err     error
}

func (e *APIError) Error() string { return fmt.Sprintf("faultctl: %d: %s", e.Status, e.Message) }
func (e *APIError) Unwrap() error { return e.Err }

func (c *Client) do(ctx context.Context, method, path string, in, out any) error {
	var body io.Reader
	if in != nil {
		b, err := json.Marshal(in)
		if err != nil {
			return err
		}
		body = bytes.NewReader(b)
	}
	req, err := http.NewRequestWithContext(ctx, method, strings.TrimSuffix(c.Base, "/")+path, body)
	if err != nil {
		return err
	}
	req.Header.Set("Authorization", "Bearer "+c.Token)
	if in != nil {
		req.Header.Set("Content-Type", "application/json")
	}
	hc := c.HTTP
	if hc == nil {
		hc = http.DefaultClient
	}
	resp, err := hc.Do(req)
	if err != nil {
		return err
	}
	defer resp.Body.Close()
	b, err := io.ReadAll(io.LimitReader(resp.Body, 4<<20))
	if err != nil {
		return err
	}
	if resp.StatusCode/100 != 2 {
		var eb errorBody
		_ = json.Unmarshal(b, &eb)
		ae := &APIError{Status: resp.StatusCode, Message: eb.Error}
		switch resp.StatusCode {
		case http.StatusBadRequest:
			ae.Err = ErrInvalid
		case http.StatusNotFound:
			ae.Err = ErrNotFound
		case http.StatusConflict:
			ae.Err = ErrConflict
		case http.StatusUnauthorized:
			ae.Err = ErrUnauthorized
		}
		return ae
	}
	if out == nil {
		return nil
	}
	return json.Unmarshal(b, out)
}

// Proxies lists every proxy.
func (c *Client) Proxies(ctx context.Context) ([]ProxyInfo, error) {
	var out []ProxyInfo
	return out, c.do(ctx, http.MethodGet, "/v1/proxies", nil, &out)
}

// Proxy returns one proxy.
func (c *Client) Proxy(ctx context.Context, name string) (ProxyInfo, error) {
	var out ProxyInfo
	return out, c.do(ctx, http.MethodGet, "/v1/proxies/"+name, nil, &out)
}

// CreateProxy creates a proxy.
func (c *Client) CreateProxy(ctx context.Context, s ProxySpec) (ProxyInfo, error) {
	var out ProxyInfo
	return out, c.do(ctx, http.MethodPost, "/v1/proxies", s, &out)
}

// DeleteProxy closes a proxy.
func (c *Client) DeleteProxy(ctx context.Context, name string) error {
	return c.do(ctx, http.MethodDelete, "/v1/proxies/"+name, nil, nil)
}

// AddFault adds a fault to a proxy.
func (c *Client) AddFault(ctx context.Context, proxy string, s FaultSpec) (FaultInfo, error) {
	var out FaultInfo
	return out, c.do(ctx, http.MethodPost, "/v1/proxies/"+proxy+"/faults", s, &out)
}

// RemoveFault removes one fault.
func (c *Client) RemoveFault(ctx context.Context, proxy, fault string) error {
	return c.do(ctx, http.MethodDelete, "/v1/proxies/"+proxy+"/faults/"+fault, nil, nil)
}

// Heal removes every fault of a proxy.
func (c *Client) Heal(ctx context.Context, proxy string) error {
	return c.do(ctx, http.MethodDelete, "/v1/proxies/"+proxy+"/faults", nil, nil)
}

// Cut closes every connection open on a tcp proxy.
func (c *Client) Cut(ctx context.Context, proxy string) (int, error) {
	var out ActionResult
	return out.Connections, c.do(ctx, http.MethodPost, "/v1/proxies/"+proxy+"/cut", nil, &out)
}

// HalfOpen makes every connection open on a tcp proxy half-open.
func (c *Client) HalfOpen(ctx context.Context, proxy string) (int, error) {
	var out ActionResult
	return out.Connections, c.do(ctx, http.MethodPost, "/v1/proxies/"+proxy+"/half-open", nil, &out)
}
