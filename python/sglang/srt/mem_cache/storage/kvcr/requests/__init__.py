"""Per request: which pages to fetch, their claims, and what KVCR holds.

``fetch_plan`` picks a request's wanted pages, ``preparation`` fetches them into
claimed KVCR DRAM and answers readiness, ``residency`` mirrors KVCR's inventory.
Imports ``config``, ``layout``, ``fleet``, ``observability``, ``sglang_hooks``
(the hook protocol) and ``owner`` (its commands).
"""
