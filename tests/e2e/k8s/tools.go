//go:build tools

// Package k8sbins pins the Kubernetes release whose kube-apiserver and
// kube-controller-manager the end-to-end tests run (built by scripts/e2e-deps.sh).
package k8sbins

import (
	_ "k8s.io/kubernetes/cmd/kube-apiserver"
	_ "k8s.io/kubernetes/cmd/kube-controller-manager"
)
