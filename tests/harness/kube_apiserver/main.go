// Command kubeapiserver runs a single-node Kubernetes control plane for tests: an embedded
// etcd member followed by a real kube-apiserver in the same process.
//
// Usage:
//
//	kubeapiserver -etcd-dir DIR -etcd-client-port N -etcd-peer-port M \
//	    [-service-account-key FILE] [-exit-on-stdin-eof] -- <kube-apiserver flags>
//
// --etcd-servers is appended to the kube-apiserver flags. When -service-account-key names a
// file that does not exist, a 2048-bit RSA key is written there first, so callers need no
// crypto library of their own. With -exit-on-stdin-eof the process shuts down (as on SIGTERM)
// when its standard input closes: a test runner that dies cannot leave a server behind.
package main

import (
	"crypto/rand"
	"crypto/rsa"
	"crypto/x509"
	"encoding/pem"
	"errors"
	"flag"
	"fmt"
	"io"
	"io/fs"
	"net/url"
	"os"
	"syscall"
	"time"

	"go.etcd.io/etcd/server/v3/embed"
	"k8s.io/kubernetes/cmd/kube-apiserver/app"
)

func main() {
	if err := run(os.Args[1:]); err != nil {
		fmt.Fprintf(os.Stderr, "kubeapiserver: %v\n", err)
		os.Exit(1)
	}
}

func run(args []string) error {
	flags := flag.NewFlagSet("kubeapiserver", flag.ContinueOnError)
	etcdDir := flags.String("etcd-dir", "", "etcd data directory (required)")
	clientPort := flags.Int("etcd-client-port", 0, "etcd client port on 127.0.0.1 (required)")
	peerPort := flags.Int("etcd-peer-port", 0, "etcd peer port on 127.0.0.1 (required)")
	saKey := flags.String("service-account-key", "", "RSA key file, generated when absent")
	exitOnEOF := flags.Bool("exit-on-stdin-eof", false, "shut down when stdin closes")
	if err := flags.Parse(args); err != nil {
		return err
	}
	if *etcdDir == "" || *clientPort <= 0 || *peerPort <= 0 {
		return errors.New("-etcd-dir, -etcd-client-port and -etcd-peer-port are required")
	}
	if *saKey != "" {
		if err := ensureRSAKey(*saKey); err != nil {
			return fmt.Errorf("service account key: %w", err)
		}
	}

	clientURL := url.URL{Scheme: "http", Host: fmt.Sprintf("127.0.0.1:%d", *clientPort)}
	etcd, err := startEtcd(*etcdDir, clientURL, *peerPort)
	if err != nil {
		return fmt.Errorf("etcd: %w", err)
	}
	// The apiserver owns signal handling (SIGTERM cancels its context, a second one exits);
	// etcd is closed once the apiserver has returned, so it never loses its storage mid-request.
	defer etcd.Close()

	if *exitOnEOF {
		go func() {
			_, _ = io.Copy(io.Discard, os.Stdin)
			_ = syscall.Kill(os.Getpid(), syscall.SIGTERM)
		}()
	}

	command := app.NewAPIServerCommand()
	command.SetArgs(append(flags.Args(), "--etcd-servers="+clientURL.String()))
	return command.Execute()
}

func startEtcd(dir string, clientURL url.URL, peerPort int) (*embed.Etcd, error) {
	cfg := embed.NewConfig()
	cfg.Name = "test"
	cfg.Dir = dir
	cfg.LogLevel = "warn"
	peerURL := url.URL{Scheme: "http", Host: fmt.Sprintf("127.0.0.1:%d", peerPort)}
	cfg.ListenClientUrls = []url.URL{clientURL}
	cfg.AdvertiseClientUrls = []url.URL{clientURL}
	cfg.ListenPeerUrls = []url.URL{peerURL}
	cfg.AdvertisePeerUrls = []url.URL{peerURL}
	cfg.InitialCluster = cfg.InitialClusterFromName(cfg.Name)
	etcd, err := embed.StartEtcd(cfg)
	if err != nil {
		return nil, err
	}
	select {
	case <-etcd.Server.ReadyNotify():
		return etcd, nil
	case err := <-etcd.Err():
		etcd.Close()
		return nil, err
	case <-time.After(60 * time.Second):
		etcd.Close()
		return nil, errors.New("not ready after 60s")
	}
}

func ensureRSAKey(path string) error {
	if _, err := os.Stat(path); err == nil {
		return nil
	} else if !errors.Is(err, fs.ErrNotExist) {
		return err
	}
	key, err := rsa.GenerateKey(rand.Reader, 2048)
	if err != nil {
		return err
	}
	block := &pem.Block{Type: "RSA PRIVATE KEY", Bytes: x509.MarshalPKCS1PrivateKey(key)}
	return os.WriteFile(path, pem.EncodeToMemory(block), 0o600)
}
