"""Serves a folder on 127.0.0.1 with CORS allowed, for the wasm-bindgen browser tests (their
page comes from the test runner's own origin). Usage: cors_server.py DIR PORT"""
import functools
import http.server
import sys


class Handler(http.server.SimpleHTTPRequestHandler):
    def end_headers(self):
        self.send_header("Access-Control-Allow-Origin", "*")
        super().end_headers()

    def log_message(self, *args):
        pass


directory, port = sys.argv[1], int(sys.argv[2])
http.server.ThreadingHTTPServer(("127.0.0.1", port), functools.partial(Handler, directory=directory)).serve_forever()
