// Package kube discovers engine pods through the Kubernetes API with
// client-go informers: the pods an InferencePool selects
// (inference.networking.k8s.io/v1: spec.selector.matchLabels and the first
// of spec.targetPorts), or the pods of a plain label selector and port.
// A pod is an endpoint while it is Ready, has an IP and is not
// terminating; the pool's changes (a new selector or port) apply at once.
package kube

import (
	"context"
	"errors"
	"fmt"
	"slices"
	"strings"
	"sync"
	"time"

	metav1 "k8s.io/apimachinery/pkg/apis/meta/v1"
	"k8s.io/apimachinery/pkg/apis/meta/v1/unstructured"
	"k8s.io/apimachinery/pkg/fields"
	"k8s.io/apimachinery/pkg/labels"
	"k8s.io/apimachinery/pkg/runtime"
	"k8s.io/apimachinery/pkg/runtime/schema"
	"k8s.io/apimachinery/pkg/watch"
	"k8s.io/client-go/dynamic"
	"k8s.io/client-go/rest"
	"k8s.io/client-go/tools/cache"
	"k8s.io/client-go/tools/clientcmd"

	"github.com/kvmesh/kvmesh/discovery"
)

// Pods is the core v1 pod resource.
var Pods = schema.GroupVersionResource{Version: "v1", Resource: "pods"}

// InferencePools is the InferencePool resource of the Gateway API
// Inference Extension's v1 API.
var InferencePools = schema.GroupVersionResource{Group: "inference.networking.k8s.io", Version: "v1", Resource: "inferencepools"}

// ErrInvalid is returned for an unusable Config.
var ErrInvalid = errors.New("kube: invalid")

// Config says which pods are a model's engines.
type Config struct {
	// Namespace of the pods (and of the InferencePool).
	Namespace string
	// Pool names an InferencePool whose selector and first target port
	// define the endpoints. Exclusive with Selector.
	Pool string
	// Selector is a label selector (e.g. "app=vllm,model=qwen3") and Port
	// the engines' HTTP port, when no InferencePool is used.
	Selector string
	Port     int
	// Resync is the informers' resync period. Default 10 min.
	Resync time.Duration
}

func (c Config) validate() error {
	switch {
	case c.Namespace == "":
		return fmt.Errorf("%w: a namespace is required", ErrInvalid)
	case (c.Pool == "") == (c.Selector == ""):
		return fmt.Errorf("%w: give an InferencePool or a label selector, not both or neither", ErrInvalid)
	case c.Selector != "" && (c.Port < 1 || c.Port > 65535):
		return fmt.Errorf("%w: a label selector needs the engines' port (1-65535)", ErrInvalid)
	}
	if c.Selector != "" {
		if _, err := labels.Parse(c.Selector); err != nil {
			return fmt.Errorf("%w: selector %q: %w", ErrInvalid, c.Selector, err)
		}
	}
	return nil
}

// Source is a discovery.Source over the Kubernetes API. It reads pods and
// pools through the dynamic client, field by field: the typed clientset
// and its scheme would pull every Kubernetes API group into the gateway's
// binary (and 5 CPU-minutes into every build) for the six fields it reads.
type Source struct {
	cfg Config
	dyn dynamic.Interface
}

var _ discovery.Source = (*Source)(nil)

// New makes a Source over a dynamic client.
func New(cfg Config, dyn dynamic.Interface) (*Source, error) {
	if err := cfg.validate(); err != nil {
		return nil, err
	}
	if dyn == nil {
		return nil, fmt.Errorf("%w: no client", ErrInvalid)
	}
	if cfg.Resync <= 0 {
		cfg.Resync = 10 * time.Minute
	}
	return &Source{cfg: cfg, dyn: dyn}, nil
}

// NewFromEnvironment makes a Source with the in-cluster credentials, or
// with kubeconfig when it is set (a path; "" and outside a cluster: the
// default loading rules, $KUBECONFIG and ~/.kube/config).
func NewFromEnvironment(cfg Config, kubeconfig string) (*Source, error) {
	var rc *rest.Config
	var err error
	if kubeconfig == "" {
		rc, err = rest.InClusterConfig()
	}
	if kubeconfig != "" || errors.Is(err, rest.ErrNotInCluster) {
		rules := clientcmd.NewDefaultClientConfigLoadingRules()
		rules.ExplicitPath = kubeconfig
		rc, err = clientcmd.NewNonInteractiveDeferredLoadingClientConfig(rules, &clientcmd.ConfigOverrides{}).ClientConfig()
	}
	if err != nil {
		return nil, fmt.Errorf("kube: credentials: %w", err)
	}
	rc.UserAgent = "kvmesh-discovery"
	dyn, err := dynamic.NewForConfig(rc)
	if err != nil {
		return nil, fmt.Errorf("kube: client: %w", err)
	}
	return New(cfg, dyn)
}

func (s *Source) String() string {
	if s.cfg.Pool != "" {
		return fmt.Sprintf("kubernetes:inferencepool/%s/%s", s.cfg.Namespace, s.cfg.Pool)
	}
	return fmt.Sprintf("kubernetes:pods/%s?%s:%d", s.cfg.Namespace, s.cfg.Selector, s.cfg.Port)
}

// target is what selects the endpoints: the pool's or the config's.
type target struct {
	sel  labels.Selector // nil: nothing selected yet (the pool is missing)
	port int
}

// Run watches the pods (and the pool) and reports each change of the
// ready endpoints, the first time once the informers have synced.
func (s *Source) Run(ctx context.Context, update func([]discovery.Endpoint)) error {
	var (
		mu     sync.Mutex
		tgt    target
		last   []discovery.Endpoint
		synced bool
	)
	if s.cfg.Selector != "" {
		sel, _ := labels.Parse(s.cfg.Selector)
		tgt = target{sel: sel, port: s.cfg.Port}
	}
	pods := s.dyn.Resource(Pods).Namespace(s.cfg.Namespace)
	podInf := cache.NewSharedIndexInformer(&cache.ListWatch{
		ListWithContextFunc: func(ctx context.Context, o metav1.ListOptions) (runtime.Object, error) {
			return pods.List(ctx, o)
		},
		WatchFuncWithContext: func(ctx context.Context, o metav1.ListOptions) (watch.Interface, error) {
			return pods.Watch(ctx, o)
		},
	}, &unstructured.Unstructured{}, s.cfg.Resync, cache.Indexers{})
	// recompute reports the endpoints when they changed. Called with mu.
	recompute := func() {
		if !synced {
			return
		}
		var eps []discovery.Endpoint
		if tgt.sel != nil && tgt.port > 0 {
			for _, o := range podInf.GetStore().List() {
				p, ok := o.(*unstructured.Unstructured)
				if !ok || !tgt.sel.Matches(labels.Set(p.GetLabels())) {
					continue
				}
				if ip, ok := readyIP(p); ok {
					eps = append(eps, discovery.Endpoint{Name: p.GetName(), IP: ip, Port: tgt.port})
				}
			}
		}
		slices.SortFunc(eps, func(a, b discovery.Endpoint) int { return strings.Compare(a.Name, b.Name) })
		if last != nil && slices.Equal(eps, last) {
			return
		}
		if eps == nil {
			eps = []discovery.Endpoint{}
		}
		last = eps
		update(slices.Clone(eps))
	}
	onChange := cache.ResourceEventHandlerFuncs{
		AddFunc:    func(any) { mu.Lock(); recompute(); mu.Unlock() },
		UpdateFunc: func(any, any) { mu.Lock(); recompute(); mu.Unlock() },
		DeleteFunc: func(any) { mu.Lock(); recompute(); mu.Unlock() },
	}
	if _, err := podInf.AddEventHandler(onChange); err != nil {
		return err
	}
	informers := []cache.SharedIndexInformer{podInf}
	if s.cfg.Pool != "" {
		res := s.dyn.Resource(InferencePools).Namespace(s.cfg.Namespace)
		byName := fields.OneTermEqualSelector("metadata.name", s.cfg.Pool).String()
		pool := cache.NewSharedIndexInformer(&cache.ListWatch{
			ListWithContextFunc: func(ctx context.Context, o metav1.ListOptions) (runtime.Object, error) {
				o.FieldSelector = byName
				return res.List(ctx, o)
			},
			WatchFuncWithContext: func(ctx context.Context, o metav1.ListOptions) (watch.Interface, error) {
				o.FieldSelector = byName
				return res.Watch(ctx, o)
			},
		}, &unstructured.Unstructured{}, s.cfg.Resync, cache.Indexers{})
		setPool := func(obj any, gone bool) {
			if d, ok := obj.(cache.DeletedFinalStateUnknown); ok {
				obj = d.Obj
			}
			u, ok := obj.(*unstructured.Unstructured)
			if !ok || u.GetName() != s.cfg.Pool {
				return
			}
			mu.Lock()
			defer mu.Unlock()
			tgt = target{}
			if !gone {
				tgt = poolTarget(u)
			}
			recompute()
		}
		if _, err := pool.AddEventHandler(cache.ResourceEventHandlerFuncs{
			AddFunc:    func(o any) { setPool(o, false) },
			UpdateFunc: func(_, o any) { setPool(o, false) },
			DeleteFunc: func(o any) { setPool(o, true) },
		}); err != nil {
			return err
		}
		informers = append(informers, pool)
	}
	var wg sync.WaitGroup
	defer wg.Wait()
	for _, inf := range informers {
		wg.Go(func() { inf.RunWithContext(ctx) })
		if !cache.WaitForCacheSync(ctx.Done(), inf.HasSynced) {
			return nil // ctx ended first
		}
	}
	mu.Lock()
	synced = true
	recompute()
	mu.Unlock()
	<-ctx.Done()
	return nil
}

// readyIP returns pod p's IP when it serves: Running, Ready, with an IP,
// not terminating.
func readyIP(p *unstructured.Unstructured) (string, bool) {
	if p.GetDeletionTimestamp() != nil {
		return "", false
	}
	ip, _, _ := unstructured.NestedString(p.Object, "status", "podIP")
	phase, _, _ := unstructured.NestedString(p.Object, "status", "phase")
	if ip == "" || phase != "Running" {
		return "", false
	}
	conds, _, _ := unstructured.NestedSlice(p.Object, "status", "conditions")
	for _, c := range conds {
		m, ok := c.(map[string]any)
		if ok && m["type"] == "Ready" {
			return ip, m["status"] == "True"
		}
	}
	return "", false
}

// poolTarget reads an InferencePool's selector and first target port; a
// pool without either selects nothing.
func poolTarget(u *unstructured.Unstructured) target {
	ml, found, err := unstructured.NestedStringMap(u.Object, "spec", "selector", "matchLabels")
	if err != nil || !found || len(ml) == 0 {
		return target{}
	}
	ports, found, err := unstructured.NestedSlice(u.Object, "spec", "targetPorts")
	if err != nil || !found || len(ports) == 0 {
		return target{}
	}
	first, ok := ports[0].(map[string]any)
	if !ok {
		return target{}
	}
	port, ok, _ := unstructured.NestedInt64(first, "number")
	if !ok || port < 1 || port > 65535 {
		return target{}
	}
	return target{sel: labels.SelectorFromSet(ml), port: int(port)}
}
