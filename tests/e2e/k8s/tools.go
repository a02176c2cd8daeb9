//go:build tools

// Package k8sbins pins the Kubernetes release whose components the end-to-end tests run
// (built by scripts/e2e-deps.sh): the control plane (kube-apiserver,
// kube-controller-manager, kube-scheduler) and the node (kubelet, kube-proxy).
package k8sbins

import (
	_ "k8s.io/kubernetes/cmd/kube-apiserver"
	_ "k8s.io/kubernetes/cmd/kube-controller-manager"
	_ "k8s.io/kubernetes/cmd/kube-proxy"
	_ "k8s.io/kubernetes/cmd/kube-scheduler"
	_ "k8s.io/kubernetes/cmd/kubelet"
)
