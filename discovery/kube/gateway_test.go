package kube_test

import (
	"context"
	"fmt"
	"log/slog"
	"testing"
	"time"

	"github.com/stretchr/testify/require"
	corev1 "k8s.io/api/core/v1"
	metav1 "k8s.io/apimachinery/pkg/apis/meta/v1"
	"k8s.io/apimachinery/pkg/apis/meta/v1/unstructured"
	"k8s.io/apimachinery/pkg/runtime"
	"k8s.io/apimachinery/pkg/runtime/schema"
	dynamicfake "k8s.io/client-go/dynamic/fake"

	"github.com/kvmesh/kvmesh/chaos/sim"
	"github.com/kvmesh/kvmesh/discovery/kube"
	"github.com/kvmesh/kvmesh/internal/freeport"
	"github.com/kvmesh/kvmesh/node"
)

// TestPodsReachEveryGatewayPool runs two gateways, each following the same
// API (client-go's fake dynamic client: no API server can run here) for
// an InferencePool, in front of simulated engines on their own loopback
// IPs. A pod added to the pool, and one removed from it, reach both
// gateways' pools within 2 s.
func TestPodsReachEveryGatewayPool(t *testing.T) {
	ips := []string{"127.0.0.2", "127.0.0.3"}
	port := freeport.Ports(t, 1, ips...)[0]
	for _, ip := range ips {
		cfg := sim.LocalConfig()
		cfg.Host, cfg.Port, cfg.ServedModelName = ip, port, "m"
		cfg.Logger = slog.New(slog.DiscardHandler)
		s, err := sim.NewServer(cfg)
		require.NoError(t, err)
		require.NoError(t, s.Start(context.Background()))
		t.Cleanup(func() { _ = s.Shutdown(context.Background()) })
	}
	api := dynamicfake.NewSimpleDynamicClientWithCustomListKinds(runtime.NewScheme(),
		map[schema.GroupVersionResource]string{kube.Pods: "PodList", kube.InferencePools: "InferencePoolList"},
		enginePod("vllm-0", ips[0]), pool(port))

	var gws []*node.Node
	for range 2 {
		src, err := kube.New(kube.Config{Namespace: "inference", Pool: "qwen"}, api)
		require.NoError(t, err)
		c := node.LocalConfig()
		c.Models = []node.ModelConfig{{Name: "m"}}
		c.Discovery = node.DiscoveryConfig{Source: node.DiscoverySourceKubernetes, Model: "m",
			Kubernetes: node.KubernetesDiscovery{Namespace: "inference", InferencePool: "qwen"}}
		n, err := node.New(c, nil)
		require.NoError(t, err)
		n.SetDiscoverySource(src)
		require.NoError(t, n.Start(context.Background()))
		t.Cleanup(func() {
			ctx, cancel := context.WithTimeout(context.Background(), 5*time.Second)
			defer cancel()
			require.NoError(t, n.Shutdown(ctx))
		})
		gws = append(gws, n)
	}
	for _, n := range gws {
		require.Eventually(t, n.Ready, 10*time.Second, 5*time.Millisecond)
		require.Equal(t, []string{"vllm-0"}, n.Replicas())
	}
	every := func(want ...string) {
		t.Helper()
		start := time.Now()
		for _, n := range gws {
			require.Eventually(t, func() bool { return fmt.Sprint(n.Replicas()) == fmt.Sprint(want) },
				2*time.Second-time.Since(start), time.Millisecond, "every gateway within 2 s")
		}
		t.Logf("%v on every gateway after %s", want, time.Since(start).Round(time.Millisecond))
	}
	pods := api.Resource(kube.Pods).Namespace("inference")
	_, err := pods.Create(t.Context(), enginePod("vllm-1", ips[1]), metav1.CreateOptions{})
	require.NoError(t, err)
	every("vllm-0", "vllm-1")
	require.NoError(t, pods.Delete(t.Context(), "vllm-0", metav1.DeleteOptions{}))
	every("vllm-1")
}

func enginePod(name, ip string) *unstructured.Unstructured {
	p := &corev1.Pod{
		TypeMeta:   metav1.TypeMeta{APIVersion: "v1", Kind: "Pod"},
		ObjectMeta: metav1.ObjectMeta{Name: name, Namespace: "inference", Labels: map[string]string{"app": "vllm-qwen"}},
		Status: corev1.PodStatus{Phase: corev1.PodRunning, PodIP: ip,
			Conditions: []corev1.PodCondition{{Type: corev1.PodReady, Status: corev1.ConditionTrue}}},
	}
	u, err := runtime.DefaultUnstructuredConverter.ToUnstructured(p)
	if err != nil {
		panic(err)
	}
	return &unstructured.Unstructured{Object: u}
}

func pool(port int) *unstructured.Unstructured {
	return &unstructured.Unstructured{Object: map[string]any{
		"apiVersion": "inference.networking.k8s.io/v1", "kind": "InferencePool",
		"metadata": map[string]any{"name": "qwen", "namespace": "inference"},
		"spec": map[string]any{
			"selector":    map[string]any{"matchLabels": map[string]any{"app": "vllm-qwen"}},
			"targetPorts": []any{map[string]any{"number": int64(port)}},
		},
	}}
}
