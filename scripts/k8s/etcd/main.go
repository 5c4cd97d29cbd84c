// Command etcd is etcd's own server entry point (go.etcd.io/etcd/server/v3/etcdmain), built
// from the Go module proxy by scripts/setup-k8s so that the test harness needs no download
// from elsewhere.
package main

import (
	"os"

	"go.etcd.io/etcd/server/v3/etcdmain"
)

func main() {
	etcdmain.Main(os.Args)
}
