// Command etcd is the etcd server of the version pinned in ../go.mod, built for the test matrix.
package main

import (
	"os"

	"go.etcd.io/etcd/server/v3/etcdmain"
)

func main() { etcdmain.Main(os.Args) }
