// Package deploy holds kvmesh's deployment files and the tests that keep
// them honest; it has no Go API.
//
// Files (see README.md beside this file for the commands):
//
//   - Dockerfile: static kvmesh, vllmsim and kvbench on distroless/static.
//   - compose.yaml: a laptop demo with three gateways, NATS, two simulated
//     engines, Prometheus and Grafana.
//   - kubernetes/: a kustomize base (gateway StatefulSet, client and peers
//     Services, PodDisruptionBudget, ConfigMap, ServiceMonitor) and dev/prod
//     overlays.
//   - prometheus/: the demo's scrape config, recording rules and alerts
//     (rules.yaml) and their promtool unit tests (rules_test.yaml).
//   - grafana/: the kvmesh dashboard and the demo's provisioning.
//
// The tests (go test ./deploy) build the three binaries and check that every
// flag the manifests pass exists, that every gateway config validates, that
// every metric the dashboard and the rules query is exported by a running
// gateway and simulators on loopback, and that promtool accepts the rules.
// KVMESH_DEPLOY_PROMETHEUS=1 also runs a real Prometheus (Debian package
// "prometheus") against the running binaries and asks it every dashboard
// query.
package deploy
