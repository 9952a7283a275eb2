// Command coredns is CoreDNS with only the plugins a test cluster's DNS needs: cluster names
// from the Kubernetes API, health and readiness endpoints, a cache, and logging. There is no
// forward plugin: names outside the cluster's zones are never sent anywhere.
package main

import (
	"github.com/coredns/coredns/core/dnsserver"
	"github.com/coredns/coredns/coremain"

	_ "github.com/coredns/coredns/plugin/cache"
	_ "github.com/coredns/coredns/plugin/errors"
	_ "github.com/coredns/coredns/plugin/health"
	_ "github.com/coredns/coredns/plugin/kubernetes"
	_ "github.com/coredns/coredns/plugin/loadbalance"
	_ "github.com/coredns/coredns/plugin/log"
	_ "github.com/coredns/coredns/plugin/ready"
)

func init() {
	// The order in which CoreDNS chains the plugins of a server block (its own default
	// order, restricted to the plugins linked above).
	dnsserver.Directives = []string{
		"errors", "log", "health", "ready", "cache", "loadbalance", "kubernetes",
	}
}

func main() {
	coremain.Run()
}
