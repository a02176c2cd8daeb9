//go:build tools

// Package netpolbin pins the NetworkPolicy enforcer the end-to-end nodes run: kube-router's
// network policy controller (iptables + ipset), built by scripts/e2e-deps.sh.
package netpolbin

import (
	_ "github.com/cloudnativelabs/kube-router/v2/cmd/kube-router"
)
