package kube

import (
	"context"
	"os"
	"testing"
	"time"

	"github.com/stretchr/testify/assert"
	"github.com/stretchr/testify/require"
	corev1 "k8s.io/api/core/v1"
	metav1 "k8s.io/apimachinery/pkg/apis/meta/v1"
	"k8s.io/apimachinery/pkg/apis/meta/v1/unstructured"
	"k8s.io/apimachinery/pkg/runtime"
	"k8s.io/apimachinery/pkg/runtime/schema"
	dynamicfake "k8s.io/client-go/dynamic/fake"

	"github.com/kvmesh/kvmesh/discovery"
)

// These tests run the informers against client-go's fake clientsets: no
// API server can run here (kube-apiserver needs etcd and far more than
// CI's module proxy and time allow). The fakes serve list and watch from
// an in-memory tracker, so the informer, selector and readiness logic is
// real; the API server's own field-selector filtering is not (Run
// filters the pool by name itself).

const ns = "inference"

// pod is a pod as the API server returns it (typed, then unstructured as
// the dynamic client sees it).
func pod(name, ip string, lbl map[string]string, ready bool) *unstructured.Unstructured {
	st := corev1.ConditionFalse
	if ready {
		st = corev1.ConditionTrue
	}
	p := &corev1.Pod{
		TypeMeta:   metav1.TypeMeta{APIVersion: "v1", Kind: "Pod"},
		ObjectMeta: metav1.ObjectMeta{Name: name, Namespace: ns, Labels: lbl},
		Status: corev1.PodStatus{Phase: corev1.PodRunning, PodIP: ip,
			Conditions: []corev1.PodCondition{{Type: corev1.PodScheduled, Status: corev1.ConditionTrue}, {Type: corev1.PodReady, Status: st}}},
	}
	u, err := runtime.DefaultUnstructuredConverter.ToUnstructured(p)
	if err != nil {
		panic(err)
	}
	return &unstructured.Unstructured{Object: u}
}

// fakeAPI is client-go's fake dynamic client over pods and pools.
func fakeAPI(objs ...runtime.Object) *dynamicfake.FakeDynamicClient {
	return dynamicfake.NewSimpleDynamicClientWithCustomListKinds(runtime.NewScheme(),
		map[schema.GroupVersionResource]string{Pods: "PodList", InferencePools: "InferencePoolList"}, objs...)
}

func inferencePool(name string, match map[string]any, port int64) *unstructured.Unstructured {
	return &unstructured.Unstructured{Object: map[string]any{
		"apiVersion": "inference.networking.k8s.io/v1",
		"kind":       "InferencePool",
		"metadata":   map[string]any{"name": name, "namespace": ns},
		"spec": map[string]any{
			"selector":          map[string]any{"matchLabels": match},
			"targetPorts":       []any{map[string]any{"number": port}},
			"endpointPickerRef": map[string]any{"name": "kvmesh", "port": map[string]any{"number": int64(9002)}},
		},
	}}
}

// run starts s and returns a function that waits for the next snapshot.
func run(t *testing.T, s *Source) func() []discovery.Endpoint {
	t.Helper()
	ctx, cancel := context.WithCancel(context.Background())
	snaps := make(chan []discovery.Endpoint, 64)
	done := make(chan error, 1)
	go func() { done <- s.Run(ctx, func(e []discovery.Endpoint) { snaps <- e }) }()
	t.Cleanup(func() {
		cancel()
		require.NoError(t, <-done)
	})
	return func() []discovery.Endpoint {
		select {
		case e := <-snaps:
			return e
		case <-time.After(10 * time.Second):
			t.Fatal("no snapshot within 10 s")
			return nil
		}
	}
}

func names(eps []discovery.Endpoint) []string {
	out := []string{}
	for _, e := range eps {
		out = append(out, e.Name+"@"+e.Addr())
	}
	return out
}

func TestLabelSelectorFollowsReadyPods(t *testing.T) {
	vllm := map[string]string{"app": "vllm"}
	api := fakeAPI(
		pod("a", "10.0.0.1", vllm, true),
		pod("b", "10.0.0.2", vllm, false),                         // not ready
		pod("c", "10.0.0.3", map[string]string{"app": "x"}, true), // other app
	)
	s, err := New(Config{Namespace: ns, Selector: "app=vllm", Port: 8000}, api)
	require.NoError(t, err)
	next := run(t, s)
	assert.Equal(t, []string{"a@10.0.0.1:8000"}, names(next()))

	pods := api.Resource(Pods).Namespace(ns)
	_, err = pods.UpdateStatus(t.Context(), pod("b", "10.0.0.2", vllm, true), metav1.UpdateOptions{})
	require.NoError(t, err)
	assert.Equal(t, []string{"a@10.0.0.1:8000", "b@10.0.0.2:8000"}, names(next()), "b became ready")

	_, err = pods.Create(t.Context(), pod("d", "10.0.0.4", vllm, true), metav1.CreateOptions{})
	require.NoError(t, err)
	assert.Equal(t, []string{"a@10.0.0.1:8000", "b@10.0.0.2:8000", "d@10.0.0.4:8000"}, names(next()), "scale-out")

	terminating := pod("a", "10.0.0.1", vllm, true)
	now := metav1.Now()
	terminating.SetDeletionTimestamp(&now)
	_, err = pods.Update(t.Context(), terminating, metav1.UpdateOptions{})
	require.NoError(t, err)
	assert.Equal(t, []string{"b@10.0.0.2:8000", "d@10.0.0.4:8000"}, names(next()), "a terminating pod leaves at once")

	require.NoError(t, pods.Delete(t.Context(), "d", metav1.DeleteOptions{}))
	assert.Equal(t, []string{"b@10.0.0.2:8000"}, names(next()), "scale-in")
}

func TestInferencePoolSelectsAndFollowsItsSpec(t *testing.T) {
	dyn := fakeAPI(
		pod("q1", "10.0.1.1", map[string]string{"model": "qwen"}, true),
		pod("l1", "10.0.2.1", map[string]string{"model": "llama"}, true),
		inferencePool("qwen-pool", map[string]any{"model": "qwen"}, 8000),
		inferencePool("other-pool", map[string]any{"model": "llama"}, 8001))
	s, err := New(Config{Namespace: ns, Pool: "qwen-pool"}, dyn)
	require.NoError(t, err)
	assert.Equal(t, "kubernetes:inferencepool/inference/qwen-pool", s.String())
	next := run(t, s)
	assert.Equal(t, []string{"q1@10.0.1.1:8000"}, names(next()), "only the named pool's selector counts")

	pools := dyn.Resource(InferencePools).Namespace(ns)
	_, err = pools.Update(t.Context(), inferencePool("qwen-pool", map[string]any{"model": "llama"}, 9000), metav1.UpdateOptions{})
	require.NoError(t, err)
	assert.Equal(t, []string{"l1@10.0.2.1:9000"}, names(next()), "a new selector and port apply at once")

	require.NoError(t, pools.Delete(t.Context(), "qwen-pool", metav1.DeleteOptions{}))
	assert.Empty(t, next(), "a deleted pool selects nothing")
}

func TestConfigValidation(t *testing.T) {
	api := fakeAPI()
	for _, c := range []Config{
		{Selector: "app=x", Port: 80},
		{Namespace: ns},
		{Namespace: ns, Pool: "p", Selector: "app=x", Port: 80},
		{Namespace: ns, Selector: "app=x"},
		{Namespace: ns, Selector: "app in (", Port: 80},
	} {
		_, err := New(c, api)
		assert.ErrorIs(t, err, ErrInvalid, "%+v", c)
	}
	_, err := New(Config{Namespace: ns, Pool: "p"}, nil)
	assert.ErrorIs(t, err, ErrInvalid, "no client")
}

func TestMain(m *testing.M) {
	// client-go 0.37 lists through a watch stream (WatchListClient) and
	// waits for the API server's bookmark that ends the initial list; the
	// fake client sends none, so the tests list the classic way.
	os.Setenv("KUBE_FEATURE_WatchListClient", "false")
	os.Exit(m.Run())
}
