// Command etcdctl is the etcd command-line client of the version pinned in ../go.mod.
package main

import "go.etcd.io/etcd/etcdctl/v3/ctlv3"

func main() { ctlv3.MustStart() }
