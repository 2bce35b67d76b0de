from frontend.tests.browser import chromium, page, site  # noqa: F401  (browser-test fixtures)
